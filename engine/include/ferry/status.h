// Status propagation for Ferry and for trainers that embed it.
//
// Everything in Ferry that can fail returns absl::Status or absl::StatusOr<T>; no exception crosses the
// API. These two macros are the one way to propagate them.
#ifndef FERRY_STATUS_H_
#define FERRY_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FERRY_STATUS_CONCAT_INNER_(a, b) a##b
#define FERRY_STATUS_CONCAT_(a, b) FERRY_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if it is not OK.
#define FERRY_RETURN_IF_ERROR(expr)                                   \
  do {                                                                \
    ::absl::Status ferry_status_ = (expr);                            \
    if (!ferry_status_.ok()) return ferry_status_;                    \
  } while (0)

// FERRY_ASSIGN_OR_RETURN(lhs, rexpr): evaluates `rexpr` (an absl::StatusOr<T>); on error returns its
// status from the enclosing function, otherwise moves the value into `lhs` (which may be a declaration,
// e.g. `auto x` or `std::unique_ptr<Engine> engine`).
#define FERRY_ASSIGN_OR_RETURN(lhs, rexpr) \
  FERRY_ASSIGN_OR_RETURN_IMPL_(FERRY_STATUS_CONCAT_(ferry_statusor_, __LINE__), lhs, rexpr)
#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#endif  // FERRY_STATUS_H_
