-- memory_budget.lua: keep as much optimizer state on the GPU as fits, offloading the largest groups.
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
--
-- place(), the exact rule. available = budget - reserve; need = 12 * (numel of the groups on the GPU).
--   1. Start with every group on the GPU.
--   2. While need > available, offload the largest group still on the GPU (largest numel; among
--      equal ones the earliest in parameter order).
--   So available <= 0 offloads every group with numel > 0 (an empty group needs no room and stays),
--   and a model whose state fits offloads nothing.
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

-- The placement by the rule above: group name -> "cpu" or "gpu".
local function placement_for(groups, available)
  local room = math.max(available, 0)
  local need = 0
  local placement = {}
  for _, g in ipairs(groups) do
    need = need + STATE_BYTES_PER_PARAM * g.numel
    placement[g.name] = "gpu"
  end
  -- Positions by size, largest first; ties keep parameter order.
  local order = {}
  for i = 1, #groups do order[i] = i end
  table.sort(order, function(a, b)
    if groups[a].numel ~= groups[b].numel then return groups[a].numel > groups[b].numel end
    return a < b
  end)
  for _, i in ipairs(order) do
    if need <= room then break end
    placement[groups[i].name] = "cpu"
    need = need - STATE_BYTES_PER_PARAM * groups[i].numel
  end
  return placement
end

function M.place(groups, ctx)
  local budget = parse_bytes(ctx.args, "budget", ctx.gpu_free_bytes)
  local placement = placement_for(groups, budget - parse_bytes(ctx.args, "reserve", 2^30))
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

return M
