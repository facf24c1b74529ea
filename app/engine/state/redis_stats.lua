#!lua flags=no-writes
local P = ARGV[1]
local ttl, B = tonumber(ARGV[2]), tonumber(ARGV[3])
local blocks = 0
for _, name in ipairs(redis.call('HKEYS', P .. ':locs')) do
  blocks = blocks + redis.call('ZCARD', P .. ':loc:' .. name)
end
local now = tonumber(redis.call('TIME')[1])
local last = math.floor(now / B)
local first = math.floor((now - ttl) / B) - 1
local ids = 0
for b = first, last do
  local c = redis.call('GET', P .. ':eidn:' .. string.format('%d', b))
  if c then ids = ids + tonumber(c) end
end
return {redis.call('ZCARD', P .. ':sessions'), redis.call('SCARD', P .. ':instances'),
        redis.call('HLEN', P .. ':locs'), blocks, redis.call('SCARD', P .. ':orders'), ids}
