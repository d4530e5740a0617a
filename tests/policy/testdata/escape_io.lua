-- A policy that tries to open a file from its top level.
local f = io.open("/etc/passwd", "r")
return { place = function(groups, ctx) return {} end }
