-- A policy whose place() returns a number instead of a table.
return {
  place = function(groups, ctx)
    return 42
  end,
}
