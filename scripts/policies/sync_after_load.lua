-- sync_after_load.lua: after a model-only or external load, re-sync every fp32 master from the
-- model's params before the next step.
--
-- A master copy that disagrees with the params it stands for silently undoes a load: the next step
-- updates the old master and writes it back over the loaded weights. Offloaded (CPU) masters are the
-- ones nothing else refreshes. This policy makes every master, CPU and GPU alike, agree with the
-- model after any load that did not restore the masters themselves, at the price of re-deriving
-- them from the low-precision params (the masters of groups the load did not touch are rounded to
-- their params' precision too).
--
-- Args:
--   fraction         as in offload_fraction.lua: the share of parameter elements offloaded, a
--                    number in [0, 1], default 0.5.
--   numa             optional NUMA mode for the pinned arena, as in offload_fraction.lua.
--   reset_optimizer  "auto" (default): reset the Adam moments when the load did not restore them;
--                    "always"; "never".
--
-- place(): offload_fraction.lua's rule, exactly (see there).
--
-- after_load():
--   sync: "all" (every group) when event.kind is "model_only" or "external", or when
--         event.masters_loaded is false; otherwise (a checkpoint that restored the masters of every
--         group it loaded) "none": the groups it did not load kept both params and masters.
--   reset_optimizer: per the arg; "auto" is `not event.optimizer_loaded`.
--
-- checkpoint(): the engine's defaults (not defined here).

local M = {}

local function parse_fraction(args)
  local text = args.fraction
  if text == nil then return 0.5 end
  local f = tonumber(text)
  if f == nil or f ~= f or f < 0 or f > 1 then
    error(string.format("args.fraction must be a number in [0, 1], got %q", tostring(text)), 0)
  end
  return f
end

-- offload_fraction.lua's rule (see there): the set of offloaded group names (name -> true).
local function offloaded_set(groups, fraction)
  local offload = {}
  local n = #groups
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
  local offload = offloaded_set(groups, parse_fraction(ctx.args))
  local placement = {}
  for _, g in ipairs(groups) do
    placement[g.name] = offload[g.name] and "cpu" or "gpu"
  end
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

function M.after_load(event, ctx)
  local mode = ctx.args.reset_optimizer or "auto"
  local reset
  if mode == "auto" then
    reset = not event.optimizer_loaded
  elseif mode == "always" then
    reset = true
  elseif mode == "never" then
    reset = false
  else
    error(string.format("args.reset_optimizer must be \"auto\", \"always\" or \"never\", got %q",
                        tostring(mode)), 0)
  end
  local sync = "none"
  if event.kind == "model_only" or event.kind == "external" or not event.masters_loaded then
    sync = "all"
  end
  return { sync = sync, reset_optimizer = reset }
end

return M
