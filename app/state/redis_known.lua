#!lua flags=no-writes
-- RedisStore.known_instances: ARGV prefix, instance retention, a newest ts ('' for the store's
-- own), then instance ids; returns how many instances are held at the cutoff, then 1 or 0 per
-- id. One round trip on the ingest path.
local P = ARGV[1]
local newest = tonumber(redis.call('GET', P .. ':newest') or '-inf')
if ARGV[3] ~= '' and tonumber(ARGV[3]) > newest then newest = tonumber(ARGV[3]) end
local cutoff = newest - tonumber(ARGV[2])
local low = cutoff > -math.huge and string.format('%.17g', cutoff) or '-inf'
local activity = P .. ':instance-activity'
local out = {redis.call('ZCOUNT', activity, low, '+inf')}
for i = 4, #ARGV do
  local l = redis.call('ZSCORE', activity, ARGV[i])
  out[#out + 1] = (l and tonumber(l) >= cutoff) and 1 or 0
end
return out
