// The one check of a packed batch's cu_seqlens (flash-attention / fla convention): [num_seqs + 1] boundaries,
// sequence s holding tokens [cu[s], cu[s + 1]). Every place where cu_seqlens enters from outside (a packed batch,
// `deltastack forward`'s inputs file, the torch extension's arguments) calls it before any entry is used as an
// index, so no kernel or loop ever sees a boundary outside the tokens.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace ds {

// Checks cu[0, n) against num_tokens: at least two entries, cu[0] == 0, every entry within [0, num_tokens], no
// entry below the one before it, and the last equal to num_tokens. Empty sequences (equal neighbours) are allowed.
// Int is any integer type (int32 in a PackedBatch, int64 in files and torch tensors). Throws ds::Error
// "<what>: cu_seqlens[i] = v ..." naming the first bad index and its value.
template <class Int>
void check_cu_seqlens(const Int* cu, size_t n, int64_t num_tokens, std::string_view what) {
  DS_CHECK(n >= 2, "{}: cu_seqlens needs at least two entries (0 and the token count {}), got {}", what, num_tokens, n);
  DS_CHECK(cu[0] == 0, "{}: cu_seqlens[0] = {}, must be 0", what, static_cast<int64_t>(cu[0]));
  for (size_t i = 1; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(cu[i]), prev = static_cast<int64_t>(cu[i - 1]);
    DS_CHECK(v >= 0 && v <= num_tokens, "{}: cu_seqlens[{}] = {} is outside [0, {}] (the token count)", what, i, v,
             num_tokens);
    DS_CHECK(v >= prev, "{}: cu_seqlens[{}] = {} is below cu_seqlens[{}] = {} (the entries must not decrease)", what,
             i, v, i - 1, prev);
  }
  DS_CHECK(static_cast<int64_t>(cu[n - 1]) == num_tokens,
           "{}: cu_seqlens[{}] = {}, the last entry, must be the token count {}", what, n - 1,
           static_cast<int64_t>(cu[n - 1]), num_tokens);
}

}  // namespace ds
