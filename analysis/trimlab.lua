-- Wireshark / tshark dissector for trimlab (shipped in the trimlab package).
--
--   trimlab wireshark install      # into the personal Lua plugins folder
--   tshark -X lua_script:$(trimlab wireshark path) -r run/pcaps/tlXX-ps1.pcap -Y trimlab
--
-- Gradient packets (UDP 47000 by default, and heuristically on any port): the 24-byte
-- header of trimlab.wire.HEADER_FIELDS, then the codec's body. A packet shorter than its
-- `length` field was trimmed by a switch: expert info says how many bytes were sent and
-- how many arrived, and `trimlab.bits_per_coord` how much of each coordinate survived.
-- The reliable channel (UDP 47001): parameter chunks, selective ACKs, BYE.

local HEADER_LEN = 24
local MAGIC, VERSION = 0xA, 1
local CODECS = { [1] = "fp32", [2] = "bf16", [3] = "sign_tail", [4] = "embedded" }
local CTRL_KINDS = { [1] = "PARAMS", [2] = "ACK", [3] = "BYE" }

local grad = Proto("trimlab", "trimlab gradient packet")
local gf = {
  magic = ProtoField.uint8("trimlab.magic", "Magic", base.HEX, nil, 0xF0),
  version = ProtoField.uint8("trimlab.version", "Version", base.DEC, nil, 0x0F),
  codec = ProtoField.uint8("trimlab.codec", "Codec", base.DEC, CODECS, 0xF0),
  flags = ProtoField.uint8("trimlab.flags", "Flags", base.HEX, nil, 0x0F),
  unbiased = ProtoField.bool("trimlab.flags.unbiased", "Unbiased", 4, nil, 0x1),
  rotated = ProtoField.bool("trimlab.flags.rotated", "Rotated", 4, nil, 0x2),
  planes = ProtoField.uint8("trimlab.planes", "Planes (K) / bits per value", base.DEC),
  packet = ProtoField.uint8("trimlab.packet", "Packet in span", base.DEC),
  job = ProtoField.uint16("trimlab.job", "Job", base.DEC),
  step = ProtoField.uint32("trimlab.step", "Step", base.DEC),
  rank = ProtoField.uint16("trimlab.rank", "Sender rank", base.DEC),
  bucket = ProtoField.uint16("trimlab.bucket", "Bucket / shard", base.DEC),
  span = ProtoField.uint16("trimlab.span", "Span", base.DEC),
  coords = ProtoField.uint16("trimlab.coords", "Coordinates (B)", base.DEC),
  length = ProtoField.uint16("trimlab.length", "Length as sent", base.DEC),
  scale = ProtoField.float("trimlab.scale", "Scale"),
  body = ProtoField.bytes("trimlab.body", "Body"),
  received = ProtoField.uint16("trimlab.received", "Length as received", base.DEC),
  trimmed = ProtoField.bool("trimlab.trimmed", "Trimmed"),
  bits = ProtoField.double("trimlab.bits_per_coord", "Bits per coordinate that arrived"),
}
grad.fields = gf
local ex_trimmed = ProtoExpert.new("trimlab.trimmed.expert", "trimmed", expert.group.SEQUENCE, expert.severity.NOTE)
local ex_long = ProtoExpert.new("trimlab.malformed", "longer than its length field",
                                expert.group.MALFORMED, expert.severity.ERROR)
grad.experts = { ex_trimmed, ex_long }

local function is_trimlab(tvb)
  if tvb:len() < HEADER_LEN then return false end
  local b0 = tvb(0, 1):uint()
  return bit.rshift(b0, 4) == MAGIC and bit.band(b0, 0x0F) == VERSION and tvb(18, 2):uint() >= HEADER_LEN
end

function grad.dissector(tvb, pinfo, tree)
  if not is_trimlab(tvb) then return 0 end
  local got, sent, coords = tvb:reported_len(), tvb(18, 2):uint(), tvb(16, 2):uint()
  local codec = CODECS[bit.rshift(tvb(1, 1):uint(), 4)] or "unknown codec"
  pinfo.cols.protocol = "trimlab"
  local t = tree:add(grad, tvb(), "trimlab, " .. codec)
  t:add(gf.magic, tvb(0, 1))
  t:add(gf.version, tvb(0, 1))
  t:add(gf.codec, tvb(1, 1))
  local fl = t:add(gf.flags, tvb(1, 1))
  fl:add(gf.unbiased, tvb(1, 1))
  fl:add(gf.rotated, tvb(1, 1))
  t:add(gf.planes, tvb(2, 1))
  t:add(gf.packet, tvb(3, 1))
  t:add(gf.job, tvb(4, 2))
  t:add(gf.step, tvb(6, 4))
  t:add(gf.rank, tvb(10, 2))
  t:add(gf.bucket, tvb(12, 2))
  t:add(gf.span, tvb(14, 2))
  t:add(gf.coords, tvb(16, 2))
  local lt = t:add(gf.length, tvb(18, 2))
  t:add(gf.scale, tvb(20, 4))
  if tvb:len() > HEADER_LEN then t:add(gf.body, tvb(HEADER_LEN)) end  -- what the capture kept
  t:add(gf.received, got):set_generated()
  local trimmed = got < sent
  t:add(gf.trimmed, trimmed):set_generated()
  if coords > 0 then
    t:add(gf.bits, 8.0 * (got - HEADER_LEN) / coords):set_generated()
  end
  if trimmed then
    lt:add_tvb_expert_info(ex_trimmed, tvb(18, 2), string.format("trimmed: sent %d bytes, %d arrived", sent, got))
  elseif got > sent then
    lt:add_tvb_expert_info(ex_long, tvb(18, 2), string.format("%d bytes, more than the %d sent", got, sent))
  end
  pinfo.cols.info = string.format("trimlab %s step %d rank %d bucket %d span %d packet %d%s",
    codec, tvb(6, 4):uint(), tvb(10, 2):uint(), tvb(12, 2):uint(), tvb(14, 2):uint(), tvb(3, 1):uint(),
    trimmed and string.format(" [trimmed %d of %d]", got, sent) or "")
  return tvb:len()
end

local function heuristic(tvb, pinfo, tree)
  -- a whole header whose length field is at least what arrived
  if not is_trimlab(tvb) or tvb:reported_len() > tvb(18, 2):uint() then return false end
  grad.dissector(tvb, pinfo, tree)
  return true
end

-- the reliable channel: kind, version, job, step, shard, first, count (agents/reliable.CTRL)
local ctrl = Proto("trimlab_ctrl", "trimlab reliable channel")
local cf = {
  kind = ProtoField.uint8("trimlab_ctrl.kind", "Kind", base.DEC, CTRL_KINDS),
  version = ProtoField.uint8("trimlab_ctrl.version", "Version", base.DEC),
  job = ProtoField.uint16("trimlab_ctrl.job", "Job", base.DEC),
  step = ProtoField.uint32("trimlab_ctrl.step", "Step", base.DEC),
  shard = ProtoField.uint16("trimlab_ctrl.shard", "Shard", base.DEC),
  first = ProtoField.uint16("trimlab_ctrl.first", "Chunk (PARAMS) / first chunk acknowledged (ACK)", base.DEC),
  count = ProtoField.uint16("trimlab_ctrl.count", "Chunks in shard (PARAMS) / chunks covered (ACK)", base.DEC),
  chunk = ProtoField.bytes("trimlab_ctrl.chunk", "Parameter bytes"),
  acked = ProtoField.uint16("trimlab_ctrl.acked", "Chunks held", base.DEC),
  bitmap = ProtoField.bytes("trimlab_ctrl.bitmap", "Selective-ACK bitmap (LSB first)"),
}
ctrl.fields = cf
local CTRL_LEN = 14

local function popcount(tvb)
  local n = 0
  for i = 0, tvb:len() - 1 do
    local b = tvb(i, 1):uint()
    while b > 0 do n = n + bit.band(b, 1); b = bit.rshift(b, 1) end
  end
  return n
end

function ctrl.dissector(tvb, pinfo, tree)
  if tvb:len() < CTRL_LEN then return 0 end
  local kind = tvb(0, 1):uint()
  pinfo.cols.protocol = "trimlab ctrl"
  local t = tree:add(ctrl, tvb(), "trimlab reliable channel, " .. (CTRL_KINDS[kind] or "unknown"))
  t:add(cf.kind, tvb(0, 1))
  t:add(cf.version, tvb(1, 1))
  t:add(cf.job, tvb(2, 2))
  t:add(cf.step, tvb(4, 4))
  t:add(cf.shard, tvb(8, 2))
  t:add(cf.first, tvb(10, 2))
  t:add(cf.count, tvb(12, 2))
  local rest = tvb:len() - CTRL_LEN
  local info = string.format("trimlab %s step %d shard %d", CTRL_KINDS[kind] or "?", tvb(4, 4):uint(), tvb(8, 2):uint())
  if kind == 1 then
    if rest > 0 then t:add(cf.chunk, tvb(CTRL_LEN)) end
    info = info .. string.format(" chunk %d of %d", tvb(10, 2):uint(), tvb(12, 2):uint())
  elseif kind == 2 and rest > 0 then
    t:add(cf.bitmap, tvb(CTRL_LEN))
    local held = popcount(tvb(CTRL_LEN))
    t:add(cf.acked, held):set_generated()
    info = info .. string.format(" holds %d of chunks %d..%d", held, tvb(10, 2):uint(),
                                 tvb(10, 2):uint() + tvb(12, 2):uint() - 1)
  end
  pinfo.cols.info = info
  return tvb:len()
end

local prefs_port = 47000
grad.prefs.port = Pref.uint("Gradient UDP port", prefs_port, "the reliable channel is this port + 1")
local udp = DissectorTable.get("udp.port")
local registered = prefs_port

local function register(port)
  udp:add(port, grad)
  udp:add(port + 1, ctrl)
end

function grad.prefs_changed()
  if grad.prefs.port ~= registered then
    udp:remove(registered, grad)
    udp:remove(registered + 1, ctrl)
    registered = grad.prefs.port
    register(registered)
  end
end

register(prefs_port)
grad:register_heuristic("udp", heuristic)
