// Causal GQA attention over packed sequences through cuDNN's fused SDPA (flash attention; the math of
// attention.h, HF Qwen3_5Attention's sdpa path), built with the cudnn-frontend graph API and loaded at run time
// (dlopen of libcudnn.so.9): a machine without cuDNN keeps the simple CUDA kernel (ops/attention/cuda.h).
//
// Packed documents use cuDNN's THD layout: each document is one batch entry of a [B, H, S, D] tensor whose rows
// start at a ragged offset (cu_seqlens[i] * H * D elements) and end at a per-entry length (padding mask), so no
// copy or padding of q/k/v/o is needed. The backward is cuDNN's deterministic algorithm (bitwise reproducible;
// on Hopper it keeps dP in a workspace of B * Hq * S^2 * 2 bytes, or of a head group's
// Hq / head_groups heads when it runs by groups: AttnBounds::head_groups). To bound that workspace, documents are put in
// length buckets S = 64, 128, 256, ... (the last one the plan's max_seqlen); one graph per bucket is built once,
// for the largest count of documents that bucket can hold, and entries past the batch's count have length 0.
// Needs cuDNN >= 9.6 (GQA with ragged offsets on sm90) and a device of compute capability >= 9.0.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cudnn {

// Empty when the cuDNN backend can run here; otherwise one line saying why not (this build has no
// cudnn-frontend, libcudnn.so.9 not found, version too old, device older than sm90). Loads the library once;
// DELTASTACK_CUDNN_LIBRARY may name its path. Thread-safe.
std::string attention_unavailable();
// "9.19.0" when loaded, else empty.
std::string loaded_version();

struct AttnBounds {
  int64_t max_tokens = 0;   // N: packed tokens per call
  int64_t max_seqs = 0;     // documents per call
  int64_t max_seqlen = 0;   // longest document (<= max_tokens)
  int64_t Hq = 0, Hkv = 0, head_dim = 0;  // Hq % Hkv == 0, head_dim % 8 == 0, <= 256
  double scale = 0;         // softmax scale (head_dim^-0.5)
  int64_t rows = 0;         // the tokens are `rows` windows of max_seqlen (the trainer's micro-batch), each holding
                            // its own documents; 0: any packing. Tightens the buckets' entry counts.
  int64_t head_groups = 1;  // the backward runs as this many calls, each over Hkv / head_groups key/value heads and
                            // their query heads (Hkv % head_groups == 0): the dP workspace shrinks by that factor.
                            // Heads never mix in attention, so each call computes its heads' dq, dk, dv as the one
                            // call does (same math, cuDNN's deterministic algorithm on fewer heads).
  bool zero_workspace = false;  // zero the workspace before every call, full buckets too (else those skip it);
                                // DELTASTACK_CUDNN_ZERO_WORKSPACE=1 sets it for every Attention
};

// One length bucket: documents of lo..S tokens run as up to bmax entries of graphs of shape [bmax, H, S, D].
struct BucketShape {
  int64_t lo = 1, S = 0, bmax = 0;
};
// The buckets for `b` (host math only): S = 64, 128, 256, ... capped at max_seqlen. A bucket's documents are
// longer than the previous S, so it holds at most max_tokens / lo of them, or rows * (max_seqlen / lo) when the
// tokens are windows; never more than max_seqs; the first bucket (1..64 tokens) at most max_tokens / 32, to keep
// its dP workspace small (a batch with more short documents than that uses the simple kernel).
std::vector<BucketShape> attention_buckets(const AttnBounds& b);

class Attention {
 public:
  // Builds the forward and backward graph of every length bucket. Throws ds::Error when cuDNN is unavailable,
  // a bound is invalid (N * Hq * head_dim must fit int32), or cuDNN rejects a graph (its message is kept).
  explicit Attention(const AttnBounds& b);
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  size_t workspace_bytes() const;  // largest cuDNN workspace over all graphs (bytes)
  size_t meta_bytes() const;       // device metadata (lengths and ragged offsets) for set_batch
  // Bytes of the workspace the last forward() or backward() zeroed before cuDNN's calls: 0 when every bucket in use
  // was full (each of its entries a document of exactly its S tokens; DELTASTACK_CUDNN_ZERO_WORKSPACE=1: never 0).
  size_t zeroed_bytes() const;
  // Sorts the documents of cu_seqlens (host, int32 [num_seqs + 1], cu_seqlens[0] == 0) into buckets and copies
  // the lengths and offsets into `meta` (device, meta_bytes()) on `stream`; the host staging stays alive until
  // the next call. Returns false (nothing uploaded) when the batch has more short documents than the smallest
  // buckets were built for: the caller then uses the simple kernel for this batch.
  bool set_batch(const int32_t* cu_seqlens, int64_t num_seqs, void* meta, cudaStream_t stream);
  // q, o: bf16 [N, Hq, hd]; k, v: bf16 [N, Hkv, hd]; lse: fp32 [N, Hq] natural-log sum of exp of the scaled
  // scores (cuDNN's softmax stats). Rows of tokens outside every document are not written.
  void forward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, ds::cuda::bf16* o,
               float* lse, void* workspace, cudaStream_t stream);
  // dq: [N, Hq, hd]; dk, dv: [N, Hkv, hd] (bf16, overwritten); o and lse from forward() on the same batch.
  void backward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, const ds::cuda::bf16* o,
                const float* lse, const ds::cuda::bf16* dout, ds::cuda::bf16* dq, ds::cuda::bf16* dk,
                ds::cuda::bf16* dv, void* workspace, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds::ops::cudnn
