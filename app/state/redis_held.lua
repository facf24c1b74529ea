#!lua flags=no-writes
-- RedisStore.held_prefixes, one search round: ARGV prefix, levels k, group count g, then g trees
-- of 2^k - 1 members each (the probes of the next k levels of a binary search, breadth first;
-- "" where that search has ended), then per location its name and tree number (1-based).
-- Walks each location's tree (held: right child, else left) and returns the node it stopped at.
local P, k, g = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local size = 2 ^ k - 1
local out = {}
local i = 4 + g * size
while i <= #ARGV do
  local key, base = P .. ':loc:' .. ARGV[i], 3 + (tonumber(ARGV[i + 1]) - 1) * size
  local j = 1
  for _ = 1, k do
    local member = ARGV[base + j]
    if member == '' then break end
    if redis.call('ZSCORE', key, member) then j = 2 * j + 1 else j = 2 * j end
  end
  out[#out + 1] = j
  i = i + 2
end
return out
