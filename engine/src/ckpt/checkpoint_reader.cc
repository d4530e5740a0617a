#include "ckpt/checkpoint_reader.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/absl_compat.h"
#include "base/logging.h"
#include "ckpt/checkpoint_plan.h"  // RankFileName, ChunkEntryName
#include "ckpt/checkpoint_root.h"
#include "ckpt/ckpt_io.h"
#include "ckpt/posix_file.h"
#include "ckpt/safetensors.h"
#include "ferry/status.h"

namespace ferry {
namespace {

using ckpt_internal::Annotate;
using ckpt_internal::DescribeChunk;
using ckpt_internal::kIoChunkBytes;
using ckpt_internal::NewXxh3State;
using ckpt_internal::Xxh3State;

constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;


}  // namespace

std::string ckpt_internal::DescribeChunk(const TensorEntry& e, const ManifestChunk& c) {
  const uint64_t es = DTypeSize(e.dtype);
  return absl::StrCat("bytes [", c.file_offset, ", ", c.file_offset + c.length, ") of ", c.file,
                      ", elements [", c.global_offset / es, ", ", (c.global_offset + c.length) / es,
                      ") of the tensor");
}

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpointDir(path));
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  absl::StatusOr<std::string> text = ReadFileToString(manifest_path, kMaxManifestBytes);
  if (!text.ok()) {
    return Annotate(text.status(), absl::StrCat(" (reading the manifest of checkpoint ", dir, ")"));
  }
  FERRY_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(*text, manifest_path));
  std::optional<int64_t> dir_step = ParseStepDirName(PathBaseName(dir));
  if (dir_step.has_value() && *dir_step != manifest.step) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": step ", manifest.step,
                                            " disagrees with the directory name ", PathBaseName(dir)));
  }

  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->dir_ = dir;
  reader->step_ = manifest.step;
  reader->metadata_ = manifest.metadata;
  reader->skipped_ = std::move(manifest.skipped);
  // file name -> (tensor index, chunk index)
  std::map<std::string, std::vector<std::pair<size_t, size_t>>> by_file;
  for (ManifestTensor& t : manifest.tensors) {
    const uint64_t es = DTypeSize(t.dtype);
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const ManifestChunk& c = t.chunks[k];
      const std::string where =
          absl::StrCat(manifest_path, ": tensor '", t.name, "' chunks[", k, "]");
      if (c.file != RankFileName(c.rank)) {
        return absl::DataLossError(absl::StrCat(where, ": a chunk of rank ", c.rank,
                                                " must be in ", RankFileName(c.rank), ", not ",
                                                c.file));
      }
      if (c.global_offset % es != 0 || c.length % es != 0) {
        return absl::DataLossError(absl::StrCat(where, ": offset ", c.global_offset,
                                                " and length ", c.length,
                                                " must be whole elements of ", es, " bytes"));
      }
      by_file[c.file].emplace_back(reader->tensors_.size(), k);
    }
    const ManifestChunk& first = t.chunks[0];
    reader->index_.emplace(t.name, reader->tensors_.size());
    reader->tensors_.push_back({.name = std::move(t.name),
                                .kind = std::move(t.kind),
                                .group = std::move(t.group),
                                .dtype = t.dtype,
                                .shape = std::move(t.shape),
                                .bytes = t.bytes,
                                .checksum = first.checksum,
                                .file = first.file,
                                .file_offset = first.file_offset,
                                .chunks = std::move(t.chunks)});
  }

  for (auto& [file_name, refs] : by_file) {
    const std::string file_path = JoinPath(dir, file_name);
    auto chunk_of = [&](const std::pair<size_t, size_t>& ref) -> const ManifestChunk& {
      return reader->tensors_[ref.first].chunks[ref.second];
    };
    std::sort(refs.begin(), refs.end(), [&](const auto& a, const auto& b) {
      return chunk_of(a).file_offset < chunk_of(b).file_offset;
    });
    absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(file_path);
    if (!file.ok()) {
      return Annotate(file.status(),
                      absl::StrCat(" (", manifest_path, " places tensor '",
                                   reader->tensors_[refs[0].first].name, "' there)"));
    }
    // Truncation first: it names the first tensor that does not fit, even when the header is gone
    // too.
    for (const auto& ref : refs) {
      const ManifestChunk& c = chunk_of(ref);
      if (c.file_offset + c.length > file->size()) {
        const TensorEntry& e = reader->tensors_[ref.first];
        return absl::DataLossError(absl::StrCat(file_path, " is truncated: it has ", file->size(),
                                                " bytes, but tensor '", e.name, "' occupies ",
                                                DescribeChunk(e, c)));
      }
    }
    FERRY_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(*file));
    absl::flat_hash_map<absl::string_view, const SafetensorsEntry*> in_header;
    for (const SafetensorsEntry& h : header.entries) in_header.emplace(h.name, &h);
    for (const auto& ref : refs) {
      const TensorEntry& e = reader->tensors_[ref.first];
      const ManifestChunk& c = chunk_of(ref);
      const std::string entry_name =
          ChunkEntryName(e.name, e.dtype, e.bytes, c.global_offset, c.length);
      auto it = in_header.find(entry_name);
      if (it == in_header.end()) {
        return absl::DataLossError(absl::StrCat(file_path, ": '", entry_name, "' (tensor '",
                                                e.name, "' of ", manifest_path,
                                                ") is missing from the safetensors header"));
      }
      const SafetensorsEntry& h = *it->second;
      const bool whole = c.length == e.bytes;
      const std::vector<int64_t> shape =
          whole ? e.shape
                : std::vector<int64_t>{static_cast<int64_t>(c.length / DTypeSize(e.dtype))};
      if (h.dtype != e.dtype || h.shape != shape ||
          header.data_start + h.begin != c.file_offset) {
        return absl::DataLossError(absl::StrCat(
            file_path, ": the safetensors header disagrees with ", manifest_path, " on tensor '",
            e.name, "' ('", entry_name, "'): header says ", ToAbsl(DTypeSafetensorsName(h.dtype)),
            " ", ShapeString(h.shape), " at file offset ", header.data_start + h.begin,
            ", manifest says ", ToAbsl(DTypeSafetensorsName(e.dtype)), " ", ShapeString(shape),
            " at ", c.file_offset));
      }
      in_header.erase(it);
    }
    if (!in_header.empty()) {
      return absl::DataLossError(absl::StrCat(file_path, ": the safetensors header lists tensor '",
                                              in_header.begin()->first, "' that ", manifest_path,
                                              " does not place in this file"));
    }
    if (header.metadata != reader->metadata_) {
      return absl::DataLossError(
          absl::StrCat(file_path, ": the safetensors __metadata__ (", header.metadata.size(),
                       " entries) differs from the "
                       "metadata in ",
                       manifest_path, " (", reader->metadata_.size(), " entries)"));
    }
    reader->files_.emplace(file_name, std::make_unique<ReadOnlyFile>(*std::move(file)));
  }
  return reader;
}

const TensorEntry* CheckpointReader::Find(std::string_view name) const {
  auto it = index_.find(ToAbsl(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status CheckpointReader::ReadChunk(const TensorEntry& entry, const ManifestChunk& c,
                                         uint64_t offset, char* dst, uint64_t n) const {
  auto file_it = files_.find(c.file);
  FERRY_CHECK(file_it != files_.end()) << "Open() opened every file of the manifest";
  const ReadOnlyFile& file = *file_it->second;
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());
  // The part of the chunk the caller wants, in global bytes: [lo, hi).
  const uint64_t chunk_end = c.global_offset + c.length;
  const uint64_t lo = dst == nullptr ? 0 : std::max(offset, c.global_offset);
  const uint64_t hi = dst == nullptr ? 0 : std::min(offset + n, chunk_end);
  // A chunk wanted whole is read straight into dst; anything else goes through a bounded scratch
  // buffer, since the checksum covers the whole chunk.
  const bool direct = dst != nullptr && lo == c.global_offset && hi == chunk_end;
  std::vector<char> scratch;
  if (!direct) scratch.resize(static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, c.length)));
  for (uint64_t done = 0; done < c.length;) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, c.length - done));
    char* piece = direct ? dst + (c.global_offset - offset) + done : scratch.data();
    absl::Status s = file.ReadAt(c.file_offset + done, piece, m);
    if (!s.ok()) return Annotate(s, absl::StrCat(" (reading tensor '", entry.name, "')"));
    XXH3_64bits_update(hash.get(), piece, m);
    if (!direct && lo < hi) {
      const uint64_t begin = std::max(lo, c.global_offset + done);
      const uint64_t end = std::min(hi, c.global_offset + done + m);
      if (begin < end) {
        std::memcpy(dst + (begin - offset), piece + (begin - c.global_offset - done),
                    static_cast<size_t>(end - begin));
      }
    }
    done += m;
  }
  const uint64_t found = XXH3_64bits_digest(hash.get());
  if (found != c.checksum) {
    return absl::DataLossError(absl::StrCat("checksum mismatch in ", file.path(), " for tensor '",
                                            entry.name, "' (", DescribeChunk(entry, c),
                                            "): expected ", FormatChecksum(c.checksum),
                                            ", found ", FormatChecksum(found)));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadRange(std::string_view std_name, uint64_t offset, void* dst,
                                         size_t n) const {
  const absl::string_view name = ToAbsl(std_name);
  const TensorEntry* entry = Find(std_name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor '", name, "'"));
  }
  if (offset > entry->bytes || n > entry->bytes - offset) {
    return absl::OutOfRangeError(absl::StrCat("ReadRange '", name, "': bytes [", offset, ", +", n,
                                              ") pass the end of the tensor's ", entry->bytes));
  }
  if (dst == nullptr && n > 0) {
    return absl::InvalidArgumentError(absl::StrCat("ReadRange '", name, "': null destination"));
  }
  char* out = static_cast<char*>(dst);
  for (const ManifestChunk& c : entry->chunks) {
    const bool overlaps = c.global_offset < offset + n && c.global_offset + c.length > offset;
    if (entry->bytes == 0) {
      FERRY_RETURN_IF_ERROR(ReadChunk(*entry, c, 0, nullptr, 0));  // checks the empty checksum
    } else if (overlaps) {
      FERRY_RETURN_IF_ERROR(ReadChunk(*entry, c, offset, out, n));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadTensor(std::string_view std_name, void* dst,
                                          size_t dst_bytes) const {
  const absl::string_view name = ToAbsl(std_name);
  const TensorEntry* entry = Find(std_name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor '", name, "'"));
  }
  if (dst_bytes != entry->bytes) {
    return absl::InvalidArgumentError(absl::StrCat("ReadTensor '", name, "': destination has ",
                                                   dst_bytes, " bytes, the tensor ", entry->bytes));
  }
  return ReadRange(std_name, 0, dst, dst_bytes);
}

absl::Status CheckpointReader::VerifyAll() const {
  absl::Status first;
  size_t failed = 0, total = 0;
  for (const TensorEntry& e : tensors_) {
    for (const ManifestChunk& c : e.chunks) {
      ++total;
      absl::Status s = ReadChunk(e, c, 0, nullptr, 0);
      if (!s.ok()) {
        if (failed == 0) first = s;
        ++failed;
      }
    }
  }
  if (failed > 1) {
    return Annotate(first, absl::StrCat(" [", failed, " of ", total,
                                        " chunks failed verification in ", dir_, "]"));
  }
  return first;
}

}  // namespace ferry
