-- A policy whose place() fails at run time on line 9 (inside a helper, to check the traceback).
local M = {}

local function helper(groups)
  return groups[1].name
end

local function broken(ctx)
  return ctx.missing.field
end

function M.place(groups, ctx)
  helper(groups)
  local result = broken(ctx)  -- not a tail call, so this frame shows in the traceback
  return result
end

return M
