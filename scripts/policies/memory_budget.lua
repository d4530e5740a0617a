-- memory_budget.lua: keep as much optimizer state on the GPU as fits, offloading the last groups.
--
-- A group kept on the GPU holds its fp32 master copy and both Adam moments in GPU memory: 12 bytes
-- per parameter (f32 master, exp_avg, exp_avg_sq). An offloaded group holds them in pinned host
-- memory instead. The trainer's params and grads are in GPU memory already when place() runs, so
-- ctx.gpu_free_bytes is what is left for that state.
--
-- Args (byte sizes: a plain number of bytes, or a number with a unit K, M, G, T (powers of 1000) or
-- KiB, MiB, GiB, TiB (powers of 1024); e.g. "512MiB", "2G", "1.5e9", "0"):
--   reserve  free GPU memory to leave alone for activations and workspace; default "1GiB".
--   budget   GPU memory available before the reserve is taken off; default ctx.gpu_free_bytes.
--   numa     optional NUMA mode for the pinned arena: "interleave", "bind", "preferred" or "local".
--   order    "end" (default) or "largest": which groups go first. "end" walks from the end of the
--            parameter order (with groups in forward order: the head and the last blocks, whose grads
--            a backward finishes first and whose params the next forward needs last, so that their CPU
--            update hides behind the rest of the backward and the next forward's first blocks; the
--            same reason as offload_fraction's from=end). "largest" takes the largest groups first
--            (the rule before 2026-11-27: with per-block groups it offloads the embeddings and the
--            first blocks, which the next forward waits for).
--   host_budget  pinned host memory for the offloaded state and the early steps' spare state;
--            default ctx.pinned_budget_bytes (the engine's process pinned budget, this rank's share
--            of the host) when it is > 0, else none (no bound on the spare state).
--
-- place(), the exact rule. available = max(budget - reserve, 0); need = 12 * (numel of the groups on
-- the GPU).
--   1. Start with every group on the GPU.
--   2. order = "end": walk the groups from the last in parameter order to the first, offloading each
--      while need > available. Then give back what the walk overshot: the offloaded groups, the last
--      one offloaded first, each return to the GPU when need + 12 * its numel <= available.
--      order = "largest": while need > available, offload the largest group still on the GPU (largest
--      numel; among equal ones the earliest in parameter order).
--   So available = 0 offloads every group with numel > 0 (an empty group needs no room and stays on
--   the GPU), and a model whose state fits offloads nothing.
-- The spare state (the result's "spare_state" key), when there is a host_budget. state = 12 * (numel
-- of the offloaded groups): their fp32 master and moments in pinned host memory; overlap (early
-- steps) may take as much again as spare state, and "spare_state" bounds that to a fraction of state:
--   spare_state = min(1, max(0, (host_budget - state) / state)); 1 when state = 0.
--   So 1 when the state fits twice, 0.5 when it fits one and a half times, 0 when the state alone
--   does not fit (not an error: the engine's pinned memory errors decide then). The engine takes the
--   smaller of this and EngineOptions::spare_state_fraction; the placement does not depend on it.
--   Not counted: the staging ring (4 + 4 slots of transfer_chunk_bytes, 64 MiB by default,
--   divided among the local ranks of a host), the
--   engine's rounding of each group's state to 4 KiB pages, a save's staging: leave room for them.
-- Note for hot reload (Engine::ReloadPolicy): ctx.gpu_free_bytes is measured with the current
-- placement's GPU state still allocated, so the rule sees less room than a fresh start would; pass
-- `budget` to decide from a known figure.
--
-- after_load() and checkpoint(): the engine's defaults (not defined here).

local M = {}

M.args = {
  reserve = "free GPU memory to leave alone, a byte size (default 1GiB)",
  budget = "GPU memory available before the reserve is taken off, a byte size (default gpu_free_bytes)",
  numa = "NUMA mode of the pinned arena: interleave, bind, preferred or local (default: the engine's)",
  order = "which groups go first: end (the last in parameter order, the default) or largest",
  host_budget = "pinned host memory for the offloaded state and its spare state, a byte size "
      .. "(default pinned_budget_bytes when > 0, else no bound)",
}

local STATE_BYTES_PER_PARAM = 12

local UNITS = {
  [""] = 1, B = 1,
  K = 1e3, KB = 1e3, M = 1e6, MB = 1e6, G = 1e9, GB = 1e9, T = 1e12, TB = 1e12,
  KiB = 2^10, MiB = 2^20, GiB = 2^30, TiB = 2^40,
}

-- Parses args[name] as a byte size (see the header); `default` when absent.
local function parse_bytes(args, name, default)
  local text = args[name]
  if text == nil then return default end
  local number, unit = tostring(text):match("^%s*([%d%.]+[eE]?[%+%-]?%d*)%s*(%a*)%s*$")
  local n = number and tonumber(number)
  local scale = unit and UNITS[unit]
  if n == nil or scale == nil or n ~= n or n < 0 or n * scale >= 2^53 then
    error(string.format("args.%s must be a byte size such as \"512MiB\", \"2G\" or \"1e9\", got %q",
                        name, tostring(text)), 0)
  end
  return math.floor(n * scale)
end

local function parse_order(args)
  local text = args.order
  if text == nil or text == "end" then return "end" end
  if text == "largest" then return "largest" end
  error(string.format("args.order must be \"end\" or \"largest\", got %q", tostring(text)), 0)
end

-- The placement by the rule above: group name -> "cpu" or "gpu".
local function placement_for(groups, available, order_name)
  local room = math.max(available, 0)
  local need = 0
  local placement = {}
  for _, g in ipairs(groups) do
    need = need + STATE_BYTES_PER_PARAM * g.numel
    placement[g.name] = "gpu"
  end
  local order = {}
  if order_name == "end" then
    for i = #groups, 1, -1 do order[#order + 1] = i end
  else
    -- Positions by size, largest first; ties keep parameter order.
    for i = 1, #groups do order[i] = i end
    table.sort(order, function(a, b)
      if groups[a].numel ~= groups[b].numel then return groups[a].numel > groups[b].numel end
      return a < b
    end)
  end
  local offloaded = {}
  for _, i in ipairs(order) do
    if need <= room then break end
    placement[groups[i].name] = "cpu"
    need = need - STATE_BYTES_PER_PARAM * groups[i].numel
    offloaded[#offloaded + 1] = i
  end
  if order_name == "end" then
    -- Give back the walk's overshoot, the last offloaded first (the nearest the front of the order).
    for k = #offloaded, 1, -1 do
      local g = groups[offloaded[k]]
      local bytes = STATE_BYTES_PER_PARAM * g.numel
      if need + bytes <= room then
        placement[g.name] = "gpu"
        need = need + bytes
      end
    end
  end
  return placement
end

-- The bound on the spare state by the rule above, for `placement`; nil without a host budget.
local function spare_state_for(groups, placement, host_budget)
  if host_budget == nil then return nil end
  local state = 0
  for _, g in ipairs(groups) do
    if placement[g.name] == "cpu" then state = state + STATE_BYTES_PER_PARAM * g.numel end
  end
  if state == 0 then return 1 end
  return math.min(1, math.max(0, (host_budget - state) / state))
end

function M.place(groups, ctx)
  local budget = parse_bytes(ctx.args, "budget", ctx.gpu_free_bytes)
  -- Checked before anything is decided, so that a bad host_budget is reported whatever the placement.
  local default_host = ctx.pinned_budget_bytes > 0 and ctx.pinned_budget_bytes or nil
  local host_budget = parse_bytes(ctx.args, "host_budget", default_host)
  local placement = placement_for(groups, budget - parse_bytes(ctx.args, "reserve", 2^30), parse_order(ctx.args))
  -- A group named "spare_state" keeps its placement under that key (the bound is then left out).
  local spare = spare_state_for(groups, placement, host_budget)
  if spare ~= nil and placement.spare_state == nil then placement.spare_state = spare end
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

return M
