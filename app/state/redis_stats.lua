#!lua flags=no-writes
local P = ARGV[1]
local ttl, B = tonumber(ARGV[2]), tonumber(ARGV[3])
local retention = tonumber(ARGV[4])
local iretention = tonumber(ARGV[5])
local newest = redis.call('GET', P .. ':newest')
-- instances not heard of since before their cutoff are forgotten, with their locations, even
-- while not deleted yet
local icutoff = newest and (tonumber(newest) - iretention) or -math.huge
local stale, nstale = {}, 0
if icutoff > -math.huge then
  local old = redis.call('ZRANGEBYSCORE', P .. ':instance-activity', '-inf',
                         '(' .. string.format('%.17g', icutoff))
  for _, iid in ipairs(old) do stale[iid], nstale = true, nstale + 1 end
end
-- the apply script keeps the blocks counted (nblocks); a store it has not written yet counts them
local locations = redis.call('HLEN', P .. ':locs')
local blocks = redis.call('GET', P .. ':nblocks')
if blocks then
  blocks = tonumber(blocks)
else
  blocks = 0
  for _, name in ipairs(redis.call('HKEYS', P .. ':locs')) do
    blocks = blocks + redis.call('ZCARD', P .. ':loc:' .. name)
  end
end
for iid in pairs(stale) do
  for _, tier in ipairs({'hbm', 'host', 'disk'}) do
    local name = tier .. '@' .. iid
    if redis.call('HEXISTS', P .. ':locs', name) == 1 then
      locations = locations - 1
      blocks = blocks - redis.call('ZCARD', P .. ':loc:' .. name)
    end
  end
end
local now = tonumber(redis.call('TIME')[1])
local last = math.floor(now / B)
local first = math.floor((now - ttl) / B) - 1
local ids = 0
for b = first, last do
  local c = redis.call('GET', P .. ':eidn:' .. string.format('%d', b))
  if c then ids = ids + tonumber(c) end
end
-- sessions idle since before the cutoff are forgotten, even while not deleted yet
-- (and orders, by the same rule)
local sessions, orders
local cutoff = newest and (tonumber(newest) - retention) or -math.huge
if cutoff > -math.huge then
  local low = string.format('%.17g', cutoff)
  sessions = redis.call('ZCOUNT', P .. ':sessions', low, '+inf')
  orders = redis.call('ZCOUNT', P .. ':order-activity', low, '+inf')
else
  sessions = redis.call('ZCARD', P .. ':sessions')
  orders = redis.call('ZCARD', P .. ':order-activity')
end
return {sessions, redis.call('ZCARD', P .. ':instance-activity') - nstale, locations, blocks,
        orders, ids}
