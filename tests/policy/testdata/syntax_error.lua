-- A policy with a syntax error on line 5.
local M = {}

function M.place(groups, ctx)
  return { = "cpu" }
end

return M
