-- wrk script for the tributary benchmark lab (bench/run).
--
-- * Counts responses per HTTP status in every wrk thread (wrk itself only counts "status > 399").
-- * Optionally varies the path per request: WRK_PATH_TEMPLATE="/api/v1/dashboard/{id}" with
--   WRK_ID_MAX=10000 draws {id} uniformly from 1..WRK_ID_MAX (the seeded users); with
--   WRK_ZIPF_S=1.05 as well, from a Zipf distribution of that exponent instead (id k with weight
--   1/k^s, id 1 the most frequent: what a per-user cache sees from real users). The draw is one
--   math.random() and a binary search in a table of cumulative weights built once per thread
--   (10,000 entries: about a millisecond), so it costs wrk about as little as the uniform draw.
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

local zipf_s = tonumber(os.getenv("WRK_ZIPF_S") or "0")
local cdf = nil
if template and id_max > 0 and zipf_s > 0 then
  cdf = {}
  local sum = 0
  for k = 1, id_max do
    sum = sum + k ^ -zipf_s
    cdf[k] = sum
  end
  for k = 1, id_max do
    cdf[k] = cdf[k] / sum
  end
end

-- The smallest k with cdf[k] > u: the Zipf rank (= user id) for a uniform u in [0, 1).
local function zipf_id(u)
  local lo, hi = 1, id_max
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] > u then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

if template and id_max > 0 then
  -- Defined only when needed: without a request() function wrk reuses one pre-built request.
  function request()
    local id
    if cdf then
      id = zipf_id(math.random())
    else
      id = math.random(1, id_max)
    end
    local path = string.gsub(template, "{id}", tostring(id))
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
  -- Percentiles of the fastest share s of responses, where s is the share of non-2xx answers.
  -- When every non-2xx answer is faster than every 2xx one (a limiter that fails fast in front
  -- of a 100 ms downstream), these are the client-side percentiles of the rejections; measure.py
  -- checks that gap before it reports them.
  local total, non_ok = 0, 0
  for status, count in pairs(merged) do
    total = total + count
    if status < 200 or status > 299 then
      non_ok = non_ok + count
    end
  end
  local fast_parts = {}
  if total > 0 and non_ok > 0 and non_ok < total then
    local share = non_ok / total * 100
    for _, p in ipairs({50, 99, 99.9}) do
      table.insert(fast_parts, string.format('"%s":%s', tostring(p), number(latency:percentile(share * p / 100))))
    end
    table.insert(fast_parts, string.format('"share":%s', number(share)))
    table.insert(fast_parts, string.format('"next":%s', number(latency:percentile(math.min(share + 0.1, 100)))))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"duration_us":%d,"requests":%d,"bytes":%d,"fast_share_us":{%s},' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"status":{%s},"latency_us":{"min":%s,"mean":%s,"stdev":%s,"max":%s,"percentiles":{%s}}}\n',
    summary.duration, summary.requests, summary.bytes, table.concat(fast_parts, ","),
    e.connect, e.read, e.write, e.status, e.timeout,
    table.concat(status_parts, ","),
    number(latency.min), number(latency.mean), number(latency.stdev), number(latency.max),
    table.concat(percentile_parts, ",")))
end
