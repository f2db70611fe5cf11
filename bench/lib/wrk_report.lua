-- wrk script for the tributary benchmark lab (bench/run).
--
-- * Counts responses per HTTP status in every wrk thread (wrk itself only counts "status > 399").
-- * Optionally varies the path per request: WRK_PATH_TEMPLATE="/api/v1/dashboard/{id}" with
--   WRK_ID_MAX=10000 draws {id} uniformly from 1..WRK_ID_MAX (the seeded users).
-- * After the run, done() prints one line "WRK_JSON {...}" with the percentiles (incl. p99.9),
--   counts and errors by kind; bench/lib/measure.py parses it. Latencies are in microseconds.

local threads = {}
local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("thread_id", thread_count)
  table.insert(threads, thread)
end

local template = os.getenv("WRK_PATH_TEMPLATE")
local id_max = tonumber(os.getenv("WRK_ID_MAX") or "0")

function init(args)
  statuses = {}
  math.randomseed(os.time() * 1000 + (thread_id or 0))
end

if template and id_max > 0 then
  -- Defined only when needed: without a request() function wrk reuses one pre-built request.
  function request()
    local path = string.gsub(template, "{id}", tostring(math.random(1, id_max)))
    return wrk.format(nil, path)
  end
end

local delay_ms = tonumber(os.getenv("WRK_DELAY_MS") or "0")
if delay_ms > 0 then
  -- Paces a probe: each connection waits this long before its next request, so the probe stays
  -- light (connections x 1000/delay req/s at most) instead of competing for the server's CPU.
  -- wrk starts the latency clock when the request is written, so the pause is not counted.
  function delay()
    return delay_ms
  end
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

local function number(value)
  if value ~= value or value == math.huge or value == -math.huge then
    return "null"
  end
  return string.format("%.3f", value)
end

function done(summary, latency, requests)
  local merged = {}
  for _, thread in ipairs(threads) do
    local counts = thread:get("statuses") or {}
    for status, count in pairs(counts) do
      merged[status] = (merged[status] or 0) + count
    end
  end
  local status_parts = {}
  for status, count in pairs(merged) do
    table.insert(status_parts, string.format('"%d":%d', status, count))
  end
  local percentile_parts = {}
  for _, p in ipairs({50, 75, 90, 99, 99.9, 99.99}) do
    table.insert(percentile_parts, string.format('"%s":%s', tostring(p), number(latency:percentile(p))))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"duration_us":%d,"requests":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"status":{%s},"latency_us":{"min":%s,"mean":%s,"stdev":%s,"max":%s,"percentiles":{%s}}}\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    table.concat(status_parts, ","),
    number(latency.min), number(latency.mean), number(latency.stdev), number(latency.max),
    table.concat(percentile_parts, ",")))
end
