-- offload_fraction.lua: offload a fraction of the model, by element count, to the CPU: whole groups
-- from the end of the parameter order (the default) or from its start.
--
-- Args:
--   fraction  number in [0, 1], default 0.5: the share of all parameter elements whose fp32 master
--             copy and Adam state go to pinned host memory.
--   from      "end" (default) or "start": which end of the parameter order the offloaded groups are
--             taken from. With groups in forward order (embeddings, blocks, head), "end" offloads the
--             groups whose grads a backward finishes first and the next forward needs last: their CPU
--             update has the rest of the backward and the next forward's first layers to hide behind.
--             "start" offloads the groups the next forward needs first, and its first layers wait for
--             their update (735M model, 50%, overlap, one H100: 0.98x the all-GPU iteration from the
--             end, 1.10-1.16x from the start; the bench guide). "start" was the rule before 2026-11-27.
--   numa      optional NUMA mode for the pinned arena: "interleave", "bind", "preferred" or
--             "local" (default: the engine's choice).
--
-- place(), the exact rule. Let total = the sum of numel over all groups, budget = fraction * total,
-- and the walk order be the groups in the order given (parameter order) for from = "start", that
-- order reversed for from = "end".
--   1. fraction == 0: every group stays on the GPU. fraction == 1: every group is offloaded.
--   2. Otherwise walk the groups in the walk order and offload whole groups while the running count
--      of offloaded elements stays <= budget; stop at the first group that would exceed it (the
--      offloaded groups are always a prefix of the walk order: a prefix of the parameter order for
--      "start", a suffix for "end").
--   3. If that offloaded nothing, the first group of the walk is offloaded anyway (fraction > 0
--      offloads something).
--   4. If that offloaded every group and there are at least two, the walk's last one goes back to
--      the GPU (fraction < 1 keeps something on the GPU; only possible when every group is empty).
--      A single group with 0 < fraction < 1 is offloaded.
--   Every group not offloaded stays on the GPU.
--
-- after_load(): re-sync the fp32 masters of every group whose masters were not loaded: all groups
--   when event.masters_loaded is false, else the groups missing from event.groups. Reset the
--   optimizer state when it was not loaded.
--
-- checkpoint(): the defaults, spelled out: nothing skipped, synchronous, keep every checkpoint.

local M = {}

-- The args this policy takes: any other is refused (naming it), so a misspelling cannot fall back to
-- a default unnoticed.
M.args = {
  fraction = "share of all parameter elements offloaded, a number in [0, 1] (default 0.5)",
  from = "which end of the parameter order the offloaded groups come from: end (default) or start",
  numa = "NUMA mode of the pinned arena: interleave, bind, preferred or local (default: the engine's)",
}

local function parse_fraction(args)
  local text = args.fraction
  if text == nil then return 0.5 end
  local f = tonumber(text)
  if f == nil or f ~= f or f < 0 or f > 1 then
    error(string.format("args.fraction must be a number in [0, 1], got %q", tostring(text)), 0)
  end
  return f
end

local function parse_from(args)
  local text = args.from
  if text == nil or text == "end" then return true end
  if text == "start" then return false end
  error(string.format("args.from must be \"end\" or \"start\", got %q", tostring(text)), 0)
end

-- Returns the set of offloaded group names (name -> true), following the rule above; `from_end`
-- walks the groups last to first.
local function offloaded_set(all_groups, fraction, from_end)
  local offload = {}
  local n = #all_groups
  local groups = all_groups
  if from_end then
    groups = {}
    for i = n, 1, -1 do groups[#groups + 1] = all_groups[i] end
  end
  if n == 0 or fraction == 0 then return offload end
  if fraction == 1 then
    for _, g in ipairs(groups) do offload[g.name] = true end
    return offload
  end
  local total = 0
  for _, g in ipairs(groups) do total = total + g.numel end
  local budget = fraction * total
  local used, count = 0, 0
  for _, g in ipairs(groups) do
    if used + g.numel > budget then break end
    used = used + g.numel
    count = count + 1
    offload[g.name] = true
  end
  if count == 0 then
    offload[groups[1].name] = true
  elseif count == n and n >= 2 then
    offload[groups[n].name] = nil
  end
  return offload
end

function M.place(groups, ctx)
  local offload = offloaded_set(groups, parse_fraction(ctx.args), parse_from(ctx.args))
  local placement = {}
  for _, g in ipairs(groups) do
    placement[g.name] = offload[g.name] and "cpu" or "gpu"
  end
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

function M.after_load(event, ctx)
  local sync
  if not event.masters_loaded then
    sync = "all"
  else
    local loaded = {}
    for _, name in ipairs(event.groups) do loaded[name] = true end
    sync = {}
    for _, name in ipairs(event.all_groups) do
      if not loaded[name] then sync[#sync + 1] = name end
    end
  end
  return { sync = sync, reset_optimizer = not event.optimizer_loaded }
end

function M.checkpoint(info, ctx)
  return { skip = {}, async = false, keep_last = 0 }
end

return M
