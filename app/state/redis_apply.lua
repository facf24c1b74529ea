#!lua
-- RedisStore's apply script (app/state/redis.py documents its arguments and keys). It is the
-- server-side copy of the session rules of app/state/rules.py and of MemoryStore's bookkeeping
-- (app/state/memory.py): each part names what it mirrors there, and
-- tests/state/test_store_contract.py runs every case on both stores.
local argv = ARGV
local nargv = #argv
local P = argv[1]
local TTL = argv[2]
local RECENT_REQUESTS = __RECENT_REQUESTS__
local RECENT_ARRIVALS = __RECENT_ARRIVALS__
local RECENT_SIGNALS = __RECENT_SIGNALS__
local WINDOW = tonumber(argv[4])     -- reorder window (inf: tombstones never expire)
local RETENTION = tonumber(argv[5])  -- session retention (inf: sessions are never forgotten)
local IRETENTION = tonumber(argv[6])  -- instance retention (inf: instances are never forgotten)
local MAX_INSTANCES = tonumber(argv[7])  -- the most instances held (inf: no cap)
local SESSIONS = P .. ':sessions'
local INSTANCES = P .. ':instance-ids'
local INSTANCE_ACTIVITY = P .. ':instance-activity'
local ORDER_ACTIVITY = P .. ':order-activity'
local LOCS, LOCBT, LOCCL, LOCHW = P .. ':locs', P .. ':locbt', P .. ':loccl', P .. ':lochw'
local LOCNAMES = P .. ':loc-names'
-- The indexes an older version did not keep, built once from what it did: the instances' last
-- activity (the cap and the retention count from it) and the location names (the pages).
if redis.call('EXISTS', INSTANCE_ACTIVITY) == 0 and redis.call('EXISTS', INSTANCES) == 1 then
  for _, iid in ipairs(redis.call('ZRANGE', INSTANCES, 0, -1)) do
    local l = redis.call('HGET', P .. ':i:' .. iid, 'l')
    if l then redis.call('ZADD', INSTANCE_ACTIVITY, l, iid) end
  end
end
if redis.call('EXISTS', LOCNAMES) == 0 and redis.call('EXISTS', LOCS) == 1 then
  for _, name in ipairs(redis.call('HKEYS', LOCS)) do redis.call('ZADD', LOCNAMES, 0, name) end
end
-- MemoryStore._resident: blocks held over every location, kept as they change (counted once
-- where a store of an older version has none yet)
local NBLOCKS = P .. ':nblocks'
local resident = 0
if redis.call('EXISTS', NBLOCKS) == 0 then
  for _, name in ipairs(redis.call('HKEYS', LOCS)) do
    resident = resident + redis.call('ZCARD', P .. ':loc:' .. name)
  end
end
local NEWEST = P .. ':newest'

-- a stored number, or -1 ("none") when absent
local function num(x)
  if not x then return -1 end
  return tonumber(x)
end

-- a computed number as Redis parses it back to the same double
local function fmt(x)
  return string.format('%.17g', x)
end

-- MemoryStore._newest / _cutoff, rules.retention_cutoff: the newest event ts applied, and the
-- sessions' cutoff
local newest_s = redis.call('GET', NEWEST)
local newest = newest_s and tonumber(newest_s) or -math.huge
local newest_moved = false
local cutoff = newest - RETENTION
local icutoff = newest - IRETENTION

local function see(ts_s, ts)
  if ts > newest then
    newest, newest_s, newest_moved = ts, ts_s, true
    cutoff = ts - RETENTION
    icutoff = ts - IRETENTION
  end
end

-- memory._Location.advance, rules.tombstone_floor: the location's newest event ts; drops the
-- tombstones it makes dead (ts < newest - WINDOW) and returns that bound
local hws, hw_order = {}, {}
local function advance(name, ts_s, ts)
  local hw = hws[name]
  if not hw then
    local v = redis.call('HGET', LOCHW, name)
    hw = {v and tonumber(v) or -math.huge}
    hws[name] = hw
  end
  if ts > hw[1] then
    hw[1] = ts
    if not hw[2] then hw_order[#hw_order + 1] = name end
    hw[2] = ts_s
    local dead = ts - WINDOW
    if dead > -math.huge then
      redis.call('ZREMRANGEBYSCORE', P .. ':tomb:' .. name, '-inf', '(' .. fmt(dead))
    end
  end
  return hw[1] - WINDOW
end

-- sessions read in this call: sid -> fields (the stored strings, or false), plus
--   reqs (decoded request records), arr (decoded arrivals), b (new block list),
--   sig (decoded signals), moved (last activity changed: update the sessions zset)
local sessions, session_order = {}, {}
local SESSION_FIELDS = {'f', 'l', 'c', 'i', 'it', 'bts', 'k', 't', 'r', 'a', 'o', 'g', 'n'}

-- MemoryStore._session, rules.SessionRecord.touch; nil: the event is older than the cutoff.
-- A signal (`signal` true) leaves the times to the 'G' operation (rules.SessionRecord.signal).
local function touch_session(sid, ts_s, ts, signal)
  if ts < cutoff then return nil end
  local s = sessions[sid]
  if not s then
    local v = redis.call('HMGET', P .. ':s:' .. sid, unpack(SESSION_FIELDS))
    s = {}
    for n, name in ipairs(SESSION_FIELDS) do s[name] = v[n] end
    sessions[sid] = s
    session_order[#session_order + 1] = sid
  end
  if s.l and tonumber(s.l) < cutoff then
    -- forgotten: a new event starts it afresh (the write-back deletes the old hash first)
    for _, name in ipairs(SESSION_FIELDS) do s[name] = false end
    s.reqs, s.arr, s.b, s.sig, s.reset = nil, nil, nil, nil, true
  end
  if not s.f then
    s.f, s.l, s.moved = ts_s, ts_s, true
    if signal then s.o = '1' end
  elseif signal then
    return s
  elseif s.o == '1' then
    -- rules.SessionRecord.touch: a session that had only signals takes its times from this event
    s.f, s.l, s.moved, s.o = ts_s, ts_s, true, '0'
  else
    if ts < tonumber(s.f) then s.f = ts_s end
    if ts > tonumber(s.l) then s.l, s.moved = ts_s, true end
  end
  return s
end

-- Python's order of two strings (by code point: for UTF-8, by byte), which Lua's `<` (the
-- locale's collation) need not be
local function str_cmp(a, b)
  if a == b then return 0 end
  local n = math.min(#a, #b)
  for k = 1, n do
    local x, y = string.byte(a, k), string.byte(b, k)
    if x ~= y then return x < y and -1 or 1 end
  end
  return #a < #b and -1 or 1
end

-- rules.SignalEntry's order: whether signal entry x comes before y (the tuples' order)
local function signal_lt(x, y)
  local a, b = tonumber(x[1]), tonumber(y[1])
  if a ~= b then return a < b end
  for k = 2, 4 do
    local c = str_cmp(x[k], y[k])
    if c ~= 0 then return c < 0 end
  end
  a, b = tonumber(x[5]), tonumber(y[5])
  if a ~= b then return a < b end
  return tonumber(x[6]) < tonumber(y[6])
end

-- rules.SessionRecord.signal, rules.add_signal: one more signal, the greatest RECENT_SIGNALS
-- kept (sorted); a session that had only signals takes its times from them
local function add_signal(s, entry)
  s.n = tostring((s.n and tonumber(s.n) or 0) + 1)
  if not s.sig then s.sig = s.g and cjson.decode(s.g) or {} end
  local sig = s.sig
  local pos = #sig + 1
  while pos > 1 and signal_lt(entry, sig[pos - 1]) do pos = pos - 1 end
  table.insert(sig, pos, entry)
  if #sig > RECENT_SIGNALS then table.remove(sig, 1) end
  if s.o == '1' then
    local ts = tonumber(entry[1])
    if ts < tonumber(s.f) then s.f = entry[1] end
    if ts > tonumber(s.l) then s.l, s.moved = entry[1], true end
  end
end

-- instances read in this call: iid -> {l, st, status (fields to write, or nil)}
local instances, instance_order = {}, {}
local INSTANCE_TIERS = {'hbm', 'host', 'disk'}

-- MemoryStore._drop_instance: an instance and its locations gone
local function drop_instance(iid)
  for _, tier in ipairs(INSTANCE_TIERS) do
    local name = tier .. '@' .. iid
    resident = resident - redis.call('ZCARD', P .. ':loc:' .. name)
    redis.call('UNLINK', P .. ':loc:' .. name, P .. ':tomb:' .. name)
    redis.call('HDEL', LOCS, name)
    redis.call('HDEL', LOCBT, name)
    redis.call('HDEL', LOCCL, name)
    redis.call('HDEL', LOCHW, name)
    redis.call('ZREM', LOCNAMES, name)
    hws[name] = nil
  end
  redis.call('DEL', P .. ':i:' .. iid)
  redis.call('ZREM', INSTANCES, iid)
  redis.call('ZREM', INSTANCE_ACTIVITY, iid)
end

-- MemoryStore._instance: nil when the store holds MAX_INSTANCES others (the event is ignored
-- whole); one not heard of since before the cutoff is forgotten, locations too, and starts afresh
local function touch_instance(iid, ts_s, ts)
  local inst = instances[iid]
  if not inst then
    local v = redis.call('HMGET', P .. ':i:' .. iid, 'l', 'st')
    inst = {l = v[1], st = v[2]}
    instances[iid] = inst
    instance_order[#instance_order + 1] = iid
  end
  if inst.l and tonumber(inst.l) < icutoff then
    drop_instance(iid)
    inst.l, inst.st, inst.status = false, false, nil
  end
  if not inst.l then
    if MAX_INSTANCES < math.huge and
        redis.call('ZCOUNT', INSTANCE_ACTIVITY, fmt(icutoff), '+inf') >= MAX_INSTANCES then
      return nil
    end
    inst.l = ts_s
    redis.call('ZADD', INSTANCES, 0, iid)
    redis.call('ZADD', INSTANCE_ACTIVITY, ts_s, iid)
  elseif ts > tonumber(inst.l) then
    inst.l = ts_s
    redis.call('ZADD', INSTANCE_ACTIVITY, ts_s, iid)
  end
  return inst
end

-- rules.SessionRecord.request: the newest request event names the session's instance
local function name_session(s, iid, ts_s, ts)
  if ts >= num(s.it) then s.i, s.it = iid, ts_s end
end

-- rules.SessionRecord.set_blocks
local function set_blocks(s, blocks, bt, ts_s, ts)
  if blocks ~= '' and ts >= num(s.bts) then s.b, s.bts, s.k = blocks, ts_s, bt end
end

-- A context's blocks ('[5,"ab",...]', as RedisStore._blocks_json writes them) up to and
-- including the first element equal to `parent` (encoded the same way), and how many elements
-- that is; nil when no element is. Walks the string, so a comma inside a string hash is no
-- separator.
local function cut_after(ctx, parent)
  local n, i, len = 0, 2, #ctx - 1
  while i <= len do
    local j
    if ctx:sub(i, i) == '"' then
      j = i + 1
      while true do
        if j > len then return nil end  -- not a context this store wrote
        local c = ctx:sub(j, j)
        if c == '\\' then j = j + 2
        elseif c == '"' then break
        else j = j + 1 end
      end
    else
      j = (ctx:find(',', i, true) or (len + 1)) - 1
    end
    n = n + 1
    if ctx:sub(i, j) == parent then return ctx:sub(1, j), n end
    i = j + 2
  end
  return nil
end

-- rules.SessionRecord.join_blocks, on a session the router started and the store still holds
local function join_blocks(sid, ts_s, parent, blocks, added, bt, max_blocks)
  local ts = tonumber(ts_s)
  if ts < cutoff then return end
  local s = sessions[sid]
  if not s then
    local v = redis.call('HMGET', P .. ':s:' .. sid, unpack(SESSION_FIELDS))
    if not v[1] then return end
    s = {}
    for n, name in ipairs(SESSION_FIELDS) do s[name] = v[n] end
    sessions[sid] = s
    session_order[#session_order + 1] = sid
  end
  if not s.f or s.o == '1' or tonumber(s.l) < cutoff or ts < num(s.bts) then return end
  local chain, count
  added = tonumber(added)
  if parent == '' then
    chain, count = '[' .. blocks .. ']', added
  else
    -- A session forgotten and started again this call has no context yet (the old hash goes
    -- at the write-back).
    local ctx = s.b or (not s.reset and redis.call('HGET', P .. ':s:' .. sid, 'b'))
    if not ctx then return end
    local head, n = cut_after(ctx, parent)
    if not head then return end
    chain, count = head .. ',' .. blocks .. ']', n + added
  end
  if count <= tonumber(max_blocks) then s.b, s.bts, s.k = chain, ts_s, bt end
end

-- rules.request_rank
local function rank(r)
  local routed = tonumber(r[4])
  if routed >= 0 then return routed end
  local st, fi = tonumber(r[5]), tonumber(r[6])
  if st >= 0 and fi >= 0 then return math.min(st, fi) end
  if st >= 0 then return st end
  if fi >= 0 then return fi end
  return -1
end

-- rules.SessionRecord.request: the request, added when the session has not seen it
local function find_request(s, rid)
  if not s.reqs then s.reqs = s.r and cjson.decode(s.r) or {} end
  local reqs = s.reqs
  for _, r in ipairs(reqs) do
    if r[1] == rid then return r end
  end
  local r = {rid, '', '-1', '-1', '-1', '-1', '-1', '-1', '-1'}
  reqs[#reqs + 1] = r
  return r
end

-- rules.SessionRecord.request: the newest event of the request names its instance
local function name_request(r, iid, ts_s, ts)
  if ts >= tonumber(r[3]) then r[2], r[3] = iid, ts_s end
end

-- rules.SessionRecord.trim_requests: a stable sort by rank (like list.sort), then drop the oldest
local function trim_requests(s)
  local reqs = s.reqs
  local n = #reqs
  if n <= RECENT_REQUESTS then return end
  for i = 2, n do
    local r = reqs[i]
    local rk = rank(r)
    local j = i - 1
    while j >= 1 and rank(reqs[j]) > rk do
      reqs[j + 1] = reqs[j]
      j = j - 1
    end
    reqs[j + 1] = r
  end
  local keep = {}
  for i = n - RECENT_REQUESTS + 1, n do keep[#keep + 1] = reqs[i] end
  s.reqs = keep
end

-- rules.add_arrival: a routed ts into the sorted arrivals, keeping the last RECENT_ARRIVALS
local function add_arrival(s, ts_s, ts)
  if not s.arr then s.arr = s.a and cjson.decode(s.a) or {} end
  local arr = s.arr
  local pos = #arr + 1
  while pos > 1 and tonumber(arr[pos - 1]) > ts do pos = pos - 1 end
  table.insert(arr, pos, ts_s)
  if #arr > RECENT_ARRIVALS then table.remove(arr, 1) end
end

-- MemoryStore._location
local function location(name, meta, bt_new, bt_update)
  if redis.call('HSETNX', LOCS, name, meta) == 1 then
    redis.call('HSET', LOCBT, name, bt_new)
    redis.call('ZADD', LOCNAMES, 0, name)
  elseif bt_update ~= '' then
    redis.call('HSET', LOCBT, name, bt_update)
  end
end

local function apply_ops(i, last)
  -- the event's instance was refused (touch_instance): the rest of it is ignored too
  local refused = false
  while i <= last do
    local op = argv[i]
    if op == 'R' then
      -- MemoryStore._routed, rules.SessionRecord.routed
      local sid, rid, iid, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local prompt, blocks, bt = argv[i + 5], argv[i + 6], argv[i + 7]
      i = i + 8
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local s = touch_instance(iid, ts_s, ts) and touch_session(sid, ts_s, ts)
      if s then
        s.t = tostring((s.t and tonumber(s.t) or 0) + 1)
        add_arrival(s, ts_s, ts)
        name_session(s, iid, ts_s, ts)
        set_blocks(s, blocks, bt, ts_s, ts)
        local r = find_request(s, rid)
        if ts >= tonumber(r[4]) then r[4], r[7] = ts_s, prompt end
        name_request(r, iid, ts_s, ts)
        trim_requests(s)
      end
    elseif op == 'S' then
      -- MemoryStore._started, rules.SessionRecord.started
      local sid, rid, iid, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      i = i + 5
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local s = touch_instance(iid, ts_s, ts) and touch_session(sid, ts_s, ts)
      if s then
        name_session(s, iid, ts_s, ts)
        local r = find_request(s, rid)
        if ts > tonumber(r[5]) then r[5] = ts_s end
        name_request(r, iid, ts_s, ts)
        trim_requests(s)
      end
    elseif op == 'F' then
      -- MemoryStore._finished, rules.SessionRecord.finished
      local sid, rid, iid, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local output, context, blocks, bt = argv[i + 5], argv[i + 6], argv[i + 7], argv[i + 8]
      i = i + 9
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local s = touch_instance(iid, ts_s, ts) and touch_session(sid, ts_s, ts)
      if s then
        name_session(s, iid, ts_s, ts)
        set_blocks(s, blocks, bt, ts_s, ts)
        local r = find_request(s, rid)
        if ts >= tonumber(r[6]) then r[6], r[8], r[9] = ts_s, output, context end
        name_request(r, iid, ts_s, ts)
        trim_requests(s)
      end
    elseif op == 'J' then
      local a = i + 1
      if not refused then
        join_blocks(argv[a], argv[a + 1], argv[a + 2], argv[a + 3], argv[a + 4], argv[a + 5],
          argv[a + 6])
      end
      i = i + 8
    elseif op == 'C' then
      -- MemoryStore._closed, rules.SessionRecord.closed
      local sid, ts_s = argv[i + 1], argv[i + 2]
      i = i + 3
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local s = touch_session(sid, ts_s, ts)
      if s and ts > num(s.c) then s.c = ts_s end
    elseif op == 'G' then
      -- MemoryStore._signal, rules.SessionRecord.signal
      local sid, ts_s = argv[i + 1], argv[i + 2]
      local entry = {ts_s, argv[i + 3], argv[i + 4], argv[i + 5], argv[i + 6], argv[i + 7]}
      i = i + 8
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local s = touch_session(sid, ts_s, ts, true)
      if s then add_signal(s, entry) end
    elseif op == 'K' then
      -- MemoryStore._stored, memory._Location.store
      local iid, name, meta, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local bt_new, bt_update, n = argv[i + 5], argv[i + 6], tonumber(argv[i + 7])
      local first = i + 8
      i = first + n
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      refused = iid ~= '' and not touch_instance(iid, ts_s, ts)
      if not refused then location(name, meta, bt_new, bt_update) end
      if not refused then advance(name, ts_s, ts) end  -- what tombstones are left are in force
      if not refused and ts > num(redis.call('HGET', LOCCL, name)) then
        local present, tomb = P .. ':loc:' .. name, P .. ':tomb:' .. name
        for j = first, first + n - 1 do
          local h = argv[j]
          local removed = redis.call('ZSCORE', tomb, h)
          if not removed or ts > tonumber(removed) then
            local stored = redis.call('ZSCORE', present, h)
            if not stored or ts > tonumber(stored) then
              resident = resident + redis.call('ZADD', present, ts_s, h)
            end
            if removed then redis.call('ZREM', tomb, h) end
          end
        end
      end
    elseif op == 'X' then
      -- MemoryStore._removed, memory._Location.remove
      local iid, name, meta, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local bt_new, n = argv[i + 5], tonumber(argv[i + 6])
      local first = i + 7
      i = first + n
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      refused = iid ~= '' and not touch_instance(iid, ts_s, ts)
      if refused then n = 0 else location(name, meta, bt_new, '') end
      local keep = not refused and ts >= advance(name, ts_s, ts)  -- dead on arrival: not kept
      local present, tomb = P .. ':loc:' .. name, P .. ':tomb:' .. name
      for j = first, first + n - 1 do
        local h = argv[j]
        local stored = redis.call('ZSCORE', present, h)
        if not stored or tonumber(stored) <= ts then
          if stored then resident = resident - redis.call('ZREM', present, h) end
          if keep then
            local removed = redis.call('ZSCORE', tomb, h)
            if not removed or ts > tonumber(removed) then
              redis.call('ZADD', tomb, ts_s, h)
            end
          end
        end
      end
    elseif op == 'Z' then
      -- MemoryStore._cleared, memory._Location.clear
      local iid, name, meta, ts_s = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local bt_new = argv[i + 5]
      i = i + 6
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      refused = iid ~= '' and not touch_instance(iid, ts_s, ts)
      if not refused then
        location(name, meta, bt_new, '')
        advance(name, ts_s, ts)
      end
      if not refused and ts > num(redis.call('HGET', LOCCL, name)) then
        redis.call('HSET', LOCCL, name, ts_s)
        resident = resident - redis.call('ZREMRANGEBYSCORE', P .. ':loc:' .. name, '-inf', ts_s)
        redis.call('ZREMRANGEBYSCORE', P .. ':tomb:' .. name, '-inf', ts_s)
      end
    elseif op == 'I' then
      -- MemoryStore._status
      local iid, ts_s = argv[i + 1], argv[i + 2]
      local status = {'st', ts_s, 'free', argv[i + 3], 'total', argv[i + 4], 'qd', argv[i + 5],
                      'rr', argv[i + 6]}
      i = i + 7
      local ts = tonumber(ts_s)
      see(ts_s, ts)
      local inst = touch_instance(iid, ts_s, ts)
      if inst and ts >= num(inst.st) then inst.st, inst.status = ts_s, status end
    elseif op == 'O' then
      -- MemoryStore._order: (rank, ts, status) replaces the old one when greater; an order is
      -- forgotten like a session (its last activity before the cutoff), and an event older
      -- than the cutoff is ignored
      local oid, rk_s, ts_s, status = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      local nbytes, seconds, reason = argv[i + 5], argv[i + 6], argv[i + 7]
      i = i + 8
      local ts, rk = tonumber(ts_s), tonumber(rk_s)
      see(ts_s, ts)
      if ts >= cutoff then
        local k = P .. ':o:' .. oid
        local old = redis.call('HMGET', k, 'rank', 'ts', 'status', 'l')
        local last_s = old[4] or old[2]
        if old[1] and tonumber(last_s) < cutoff then
          redis.call('DEL', k)  -- forgotten: this event starts it afresh
          old = {false, false, false, false}
        end
        local newer = not old[1]
        if not newer then
          local ork, ots = tonumber(old[1]), tonumber(old[2])
          newer = rk > ork or (rk == ork and (ts > ots or (ts == ots and status > old[3])))
        end
        if newer then
          redis.call('HSET', k, 'rank', rk_s, 'ts', ts_s, 'status', status,
                     'bytes', nbytes, 'seconds', seconds, 'reason', reason)
        end
        if not old[1] or ts > tonumber(last_s) then
          redis.call('HSET', k, 'l', ts_s)
          redis.call('ZADD', ORDER_ACTIVITY, ts_s, oid)
        end
      end
    else
      error('kvprefetch: unknown operation ' .. tostring(op))
    end
  end
end

local results, applied, in_call = {}, {}, {}
local i = 8
while i <= nargv do
  local eid, n = argv[i], tonumber(argv[i + 1])
  local first, last = i + 2, i + 1 + n
  i = last + 1
  local key = P .. ':eid:' .. eid
  if in_call[key] or redis.call('EXISTS', key) == 1 then
    results[#results + 1] = 0
  else
    in_call[key] = true
    applied[#applied + 1] = key
    apply_ops(first, last)
    results[#results + 1] = 1
  end
end

-- write back
for _, sid in ipairs(session_order) do
  local s = sessions[sid]
  if s.reqs then s.r = cjson.encode(s.reqs) end
  if s.arr then s.a = cjson.encode(s.arr) end
  if s.sig then s.g = cjson.encode(s.sig) end
  local fields = {}
  for _, name in ipairs(SESSION_FIELDS) do
    if s[name] then
      fields[#fields + 1] = name
      fields[#fields + 1] = s[name]
    end
  end
  if s.b then
    fields[#fields + 1] = 'b'
    fields[#fields + 1] = s.b
  end
  if s.reset then redis.call('DEL', P .. ':s:' .. sid) end
  redis.call('HSET', P .. ':s:' .. sid, unpack(fields))
  if s.moved then redis.call('ZADD', SESSIONS, s.l, sid) end
end
if newest_moved then redis.call('SET', NEWEST, newest_s) end
for _, name in ipairs(hw_order) do
  local hw = hws[name]  -- nil: its instance was forgotten in this call
  if hw and hw[2] then redis.call('HSET', LOCHW, name, hw[2]) end
end

-- MemoryStore._expire_sessions: forget sessions idle since before the cutoff, the oldest first,
-- at most twice as many per call as events (a call creates at most one per event: this keeps
-- up, and no call does unbounded work). The reads ignore any left for the next call.
if cutoff > -math.huge then
  local old = redis.call('ZRANGEBYSCORE', SESSIONS, '-inf', '(' .. fmt(cutoff), 'LIMIT', 0,
                         2 * #results + 16)
  if #old > 0 then
    for _, sid in ipairs(old) do redis.call('DEL', P .. ':s:' .. sid) end
    redis.call('ZREM', SESSIONS, unpack(old))
  end
  -- MemoryStore._expire_orders, by the same rule
  old = redis.call('ZRANGEBYSCORE', ORDER_ACTIVITY, '-inf', '(' .. fmt(cutoff), 'LIMIT', 0,
                   2 * #results + 16)
  if #old > 0 then
    for _, oid in ipairs(old) do redis.call('DEL', P .. ':o:' .. oid) end
    redis.call('ZREM', ORDER_ACTIVITY, unpack(old))
  end
end
for _, iid in ipairs(instance_order) do
  local inst = instances[iid]
  if inst.l then  -- false: refused, or forgotten and not started again
    local k = P .. ':i:' .. iid
    redis.call('HSET', k, 'l', inst.l)
    if inst.status then redis.call('HSET', k, unpack(inst.status)) end
  end
end
-- MemoryStore._expire_instances: forget instances not heard of since before the cutoff, with
-- their locations, as many per call as sessions (the reads ignore any left for the next call)
if icutoff > -math.huge then
  local old = redis.call('ZRANGEBYSCORE', INSTANCE_ACTIVITY, '-inf', '(' .. fmt(icutoff),
                         'LIMIT', 0, 2 * #results + 16)
  for _, iid in ipairs(old) do drop_instance(iid) end
end

if resident ~= 0 or redis.call('EXISTS', NBLOCKS) == 0 then
  redis.call('INCRBY', NBLOCKS, resident)
end

-- mark the ids, and count them for stats()
for _, key in ipairs(applied) do redis.call('SET', key, '1', 'EX', TTL) end
if #applied > 0 then
  local B = tonumber(argv[3])
  local bucket = math.floor(tonumber(redis.call('TIME')[1]) / B)
  local ck = P .. ':eidn:' .. string.format('%d', bucket)
  redis.call('INCRBY', ck, #applied)
  redis.call('EXPIREAT', ck, string.format('%d', (bucket + 1) * B + tonumber(TTL)))
end
return results
