// Byte counts and limits as the memory layer's messages print them.
#ifndef FERRY_MEMORY_FORMAT_H_
#define FERRY_MEMORY_FORMAT_H_

#include <cstddef>
#include <string>

namespace ferry::memory_internal {

// "4096 bytes", "3145728 bytes (3.00 MiB)", "17179869184 bytes (16.00 GiB)".
std::string FormatBytes(size_t bytes);

}  // namespace ferry::memory_internal

#endif  // FERRY_MEMORY_FORMAT_H_
