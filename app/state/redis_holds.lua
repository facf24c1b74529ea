#!lua flags=no-writes
-- RedisStore.holds_many: ARGV prefix, then per query a location name, a count n and n members;
-- returns 1 or 0 per member, all queries' in order. One call instead of one ZMSCORE a query.
local P = ARGV[1]
local out = {}
local i = 2
while i <= #ARGV do
  local key, n = P .. ':loc:' .. ARGV[i], tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + n do
    out[#out + 1] = redis.call('ZSCORE', key, ARGV[j]) and 1 or 0
  end
  i = i + 2 + n
end
return out
