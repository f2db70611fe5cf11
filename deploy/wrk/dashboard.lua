-- wrk script for the compose `bench` profile: GET /api/v1/dashboard/{id} over the seeded users, so the
-- database sees the key spread of real traffic rather than one hot row.
-- BENCH_USERS must not exceed the `--users` given to `tributary seed` (10000 in docker-compose.yml).
local users = tonumber(os.getenv("BENCH_USERS") or "10000")

-- Fixed seed per thread: two runs of the same build send the same request sequence.
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("seed", threads)
end

init = function(args)
  math.randomseed(tonumber(seed) or 1)
end

request = function()
  return wrk.format("GET", "/api/v1/dashboard/" .. math.random(1, users))
end

-- One JSON line at the end, so results can be collected without scraping wrk's table.
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    '{"requests":%d,"duration_s":%.3f,"rps":%.1f,"errors":%d,"non_2xx_3xx":%d,'
      .. '"latency_ms":{"p50":%.3f,"p90":%.3f,"p99":%.3f,"max":%.3f}}\n',
    summary.requests, summary.duration / 1e6, summary.requests / (summary.duration / 1e6),
    errors, summary.errors.status,
    latency:percentile(50) / 1e3, latency:percentile(90) / 1e3, latency:percentile(99) / 1e3,
    latency.max / 1e3))
end
