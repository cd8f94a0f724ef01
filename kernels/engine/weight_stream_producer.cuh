// The weight-streaming GEMMs' producer warpgroup (weight_stream_kernel.cuh): one thread
// issues each stage's TMA loads (codes, pool tile, adapter boxes); all 128 write each base
// step's scale words (mxfp4::scale_word) from loads issued a few steps ahead. A scale
// loader per code layout: StreamScaleRows (two-tile rows), StreamScaleLines (one-tile
// rows), StreamScaleColumns (the transposed kinds).
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <type_traits>

#include "fragment_decode.cuh"
#include "weight_stream_config.cuh"

namespace megamoe::kernels::engine {

// ---- producer warpgroup ----
// Thread i of the producer warpgroup writes, per base step, the scale words of two lines
// (scale_word): consumer quad i / 2's lines 2h and 2h + 1 (h = i % 2: rows r and r + 8 of
// half h), 8 bytes of the stage's scale area. It loads their bytes kScaleStepsAhead base
// steps before, so the loads' latency passes while the ring fills; the consumers then
// read ready factors with one shared load and no address math of their own.
struct StreamScaleRows {
  static constexpr int kLoads = 2, kWords = 2;
  static constexpr bool kStaged = false, kChunked = false;  // loads into registers (L1 hits)
  static constexpr int kSlots = 0;
  const uint16_t* cursor;  // row r's pair of the next base step to load
  uint32_t eight_rows;     // pairs from row r to row r + 8
  uint32_t store_offset;   // this thread's 8 bytes in a stage's scale area

  __device__ __forceinline__ StreamScaleRows(const WeightStreamParams& p, const StreamTile& tile,
                                             int thread) {
    const int slot = thread / 2, half = thread % 2;
    const uint32_t pairs_per_row = static_cast<uint32_t>(p.k_base / 64);
    const int64_t w_row = static_cast<int64_t>(tile.expert) * p.weight_rows + tile.n0 +
                          stream_scale_slot_row(slot) + half * p.half_rows;
    cursor = reinterpret_cast<const uint16_t*>(p.scales) + w_row * pairs_per_row;
    eight_rows = 8 * pairs_per_row;
    store_offset = static_cast<uint32_t>(16 * slot + 8 * half);
  }

  // The two rows' pairs of the cursor's step when `load`; the cursor moves on either way.
  __device__ __forceinline__ void load_next(bool load, uint32_t (&raw)[2]) {
    if (load) {
      raw[0] = static_cast<uint32_t>(__ldg(cursor));
      raw[1] = static_cast<uint32_t>(__ldg(cursor + eight_rows));
    }
    ++cursor;
  }

  // Row r's bytes of 16 steps share a 32-byte sector: the loads hit L1.
  static constexpr int kPrefetchSteps = 0;
  __device__ __forceinline__ void prefetch(int, bool, int) const {}

  // The step's words of the two lines (scale_word), then into a stage's scale area.
  __device__ __forceinline__ static void words(const uint32_t (&raw)[2], uint32_t (&out)[2]) {
    out[0] = mxfp4::scale_word(raw[0]);
    out[1] = mxfp4::scale_word(raw[1]);
  }
  __device__ __forceinline__ void store(uint32_t scale_area, const uint32_t (&words)[2]) const {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(scale_area + store_offset), "r"(words[0]),
                 "r"(words[1])
                 : "memory");
  }
};

// StreamScaleRows' lines and words, their bytes loaded in 8-byte chunks: four steps of a
// row in one load, the next chunk as the current one comes into use (four steps ahead). A
// warp's load reads 32 rows K / 32 bytes apart, about 32 L1 wavefronts whatever its width, so
// a chunk per four steps takes a quarter of the L1 work of a load a step (the consumers'
// shared loads of codes and words go through the same L1). For rows of whole chunks (K a
// multiple of 256), each row's step 0 begins a chunk; the launchers require 8-byte aligned
// scales.
struct StreamScaleRowChunks : StreamScaleRows {
  static constexpr bool kChunked = true;
  static constexpr int kChunkSteps = 4;             // pairs per chunk
  static constexpr int kChunkK = 64 * kChunkSteps;  // K values per chunk: 64 a base step
  const uint2* next_chunk;                          // row r's next chunk to load
  uint32_t eight_row_chunks;                        // chunks from row r to row r + 8
  uint2 current[2];  // rows r and r + 8: the chunks of this step's pairs
  uint2 next[2];     // ... and of the next four steps'

  __device__ __forceinline__ StreamScaleRowChunks(const WeightStreamParams& p,
                                                  const StreamTile& tile, int thread)
      : StreamScaleRows(p, tile, thread) {
    next_chunk = reinterpret_cast<const uint2*>(cursor);
    eight_row_chunks = eight_rows / kChunkSteps;
  }
  __device__ __forceinline__ void load(uint2 (&chunks)[2]) {
    chunks[0] = __ldg(next_chunk);
    chunks[1] = __ldg(next_chunk + eight_row_chunks);
    ++next_chunk;
  }
  // The chunk of step 0, if the tile has a step.
  __device__ __forceinline__ void start(int base_steps) {
    if (base_steps > 0) load(next);
  }
  // Base step `step` (d = step mod kChunkSteps, a constant of the unrolled loop): where a
  // chunk begins, the chunk loaded kChunkSteps steps before (or by start) becomes current,
  // copied through `opaque` so that the later steps read registers no load writes (loads
  // share a scoreboard, and a read waits for every load on it: refill's load, issued after
  // this read, stays four steps ahead).
  __device__ __forceinline__ void take(int, int d, uint32_t (&raw)[2]) {
    if (d == 0) {
#pragma unroll
      for (int row = 0; row < 2; ++row)
        current[row] = make_uint2(opaque(next[row].x), opaque(next[row].y));
    }
    const uint32_t shift = 16 * (d & 1);
#pragma unroll
    for (int row = 0; row < 2; ++row)
      raw[row] = ((d & 2) ? current[row].y : current[row].x) >> shift & 0xFFFFu;
  }
  // Where a chunk began at `step`, the chunk after it, if it holds a step of the tile's.
  __device__ __forceinline__ void refill(int step, int d, int base_steps) {
    if (d == 0 && step + kChunkSteps < base_steps) load(next);
  }
};

// One tile (192- and 256-row chunks): thread i of the producer warpgroup writes, per base step,
// the scale word of one line, consumer quad i / 2's line i % 2: row r (line 0) or r + 8
// of its warpgroup's m64 tile, Gated the gate and the up row of h column 32 c + 8 warp +
// lane / 4 (the up rows I on). 4 bytes of the stage's scale area, from one 16-bit load.
template <bool kGated>
struct StreamScaleLines {
  static constexpr int kLoads = 1, kWords = 1;
  static constexpr bool kStaged = false, kChunked = false;
  static constexpr int kSlots = 0;
  const uint16_t* cursor;  // the line's pair of the next base step to load
  uint32_t store_offset;   // this thread's word in a stage's scale area

  __device__ __forceinline__ StreamScaleLines(const WeightStreamParams& p, const StreamTile& tile,
                                              int thread) {
    const int slot = thread / 2, line = thread % 2;
    const int row = kGated ? 32 * (slot / 32) + 8 * (slot / 8 % 4) + slot % 8 + line * p.half_rows
                           : 64 * (slot / 32) + 16 * (slot / 8 % 4) + slot % 8 + 8 * line;
    const int64_t w_row = static_cast<int64_t>(tile.expert) * p.weight_rows + tile.n0 + row;
    cursor = reinterpret_cast<const uint16_t*>(p.scales) + w_row * (p.k_base / 64);
    store_offset = static_cast<uint32_t>(8 * slot + 4 * line);
  }

  __device__ __forceinline__ void load_next(bool load, uint32_t (&raw)[1]) {
    if (load) raw[0] = static_cast<uint32_t>(__ldg(cursor));
    ++cursor;
  }
  static constexpr int kPrefetchSteps = 0;
  __device__ __forceinline__ void prefetch(int, bool, int) const {}
  __device__ __forceinline__ static void words(const uint32_t (&raw)[1], uint32_t (&out)[1]) {
    out[0] = mxfp4::scale_word(raw[0]);
  }
  __device__ __forceinline__ void store(uint32_t scale_area, const uint32_t (&words)[1]) const {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(scale_area + store_offset), "r"(words[0])
                 : "memory");
  }
};

// StoreMN: a consumer thread (consumer c, warp w, lane quad t = lane % 4) reads, per base
// step, the scale words of its column block (n0 / 32 + 4 c + w) for the eight pairs of
// stored rows (16 k16 + 2 t + 8 j, + 1) it decodes: 32 bytes at slot (4 c + w) 4 + t,
// word 2 k16 + j. Thread i of the producer warpgroup writes two of them: pair (k16, j)
// = ((i / 2) % 4, i % 2) for quad t = (i / 8) % 4 of warps w = 2 ((i / 32) % 2) and w +
// 1 of consumer i / 64, from one 16-bit load of each of the two rows (both blocks).
// One tile (192- and 256-row chunks): both consumer warpgroups decode the same 64 bytes
// of a stored row, so warp w's threads of either consumer read block n0 / 32 + w at slot
// 4 w + t; thread i writes one word, pair ((i / 2) % 4, i % 2) of quad (i / 8) % 4 of
// warp i / 32, from one byte load of each of the two rows.
template <bool kOneTile, int kColumns>
struct StreamScaleColumns {
  static constexpr int kLoads = 2, kWords = kOneTile ? 1 : 2;
  using Unit = std::conditional_t<kOneTile, uint8_t, uint16_t>;  // a load: its blocks' bytes
  const Unit* cursor;     // row n's unit of the next base step to load
  uint32_t next_row;      // from row n to row n + 1 (units)
  uint32_t store_offset;  // the first word's place in a stage's scale area (two tiles: the
                          // second's is 128 bytes on, the next warp's slot)

  // The loads land in shared memory (cp.async, one commit group a step) and a step's are
  // waited for kScaleStepsAhead - 1 groups behind the newest: register loads all share one
  // scoreboard, and a wait is for every load on it, so they were one step ahead in effect
  // and each step waited for L2 (the rows are new sectors every step). A unit's 4-byte
  // aligned word is copied (cp.async's smallest size); `shift` places the unit in it.
  static constexpr bool kStaged = true, kChunked = false;
  static constexpr int kSlots = 4;  // StreamConfig::kScaleStepsAhead
  uint32_t staging;                 // this thread's slots (kSlots x two words), shared address
  uint32_t shift;  // the unit's bit offset in its aligned word (the same every step)

  __device__ __forceinline__ StreamScaleColumns(const WeightStreamParams& p, const StreamTile& tile,
                                                int thread, uint32_t staging_area) {
    const int j = thread % 2, k16 = thread / 2 % 4, quad = thread / 8 % 4;
    const int warp = kOneTile ? thread / 32 : 2 * (thread / 32 % 2);
    const int consumer = kOneTile ? 0 : thread / 64;
    const int64_t blocks_per_row = kColumns / 32 * static_cast<int64_t>(p.n_base_blocks);  // N / 32
    const int64_t row =
        static_cast<int64_t>(tile.expert) * p.weight_rows + 16 * k16 + 2 * quad + 8 * j;
    cursor = reinterpret_cast<const Unit*>(p.scales + row * blocks_per_row + tile.n0 / 32 +
                                           4 * consumer + warp);
    next_row = static_cast<uint32_t>(blocks_per_row / static_cast<int64_t>(sizeof(Unit)));
    store_offset =
        static_cast<uint32_t>(32 * ((4 * consumer + warp) * 4 + quad) + 4 * (2 * k16 + j));
    staging = staging_area + static_cast<uint32_t>(thread) * kSlots * 8;
    shift = 8 * static_cast<uint32_t>(reinterpret_cast<uintptr_t>(cursor) & 3);
  }

  // The next step's two units (rows n and n + 1) into `slot` when `load`; one commit
  // group either way, so that every step's wait counts the same groups.
  __device__ __forceinline__ void issue(bool load, int slot) {
    if (load) {
      const uint32_t at = staging + 8 * slot;
      const uintptr_t first = reinterpret_cast<uintptr_t>(cursor) & ~uintptr_t{3};
      const uintptr_t second = reinterpret_cast<uintptr_t>(cursor + next_row) & ~uintptr_t{3};
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(at), "l"(first) : "memory");
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(at + 4), "l"(second)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    cursor += 64 * next_row;  // 64 stored rows a step
  }
  // The oldest step in flight's units from `slot`, once its group (and every older) landed.
  __device__ __forceinline__ void take(int slot, uint32_t (&raw)[2]) const {
    asm volatile("cp.async.wait_group %0;" ::"n"(kSlots - 1) : "memory");
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                 : "=r"(raw[0]), "=r"(raw[1])
                 : "r"(staging + 8 * slot)
                 : "memory");
    constexpr uint32_t kUnitMask = kOneTile ? 0xFFu : 0xFFFFu;
    raw[0] = raw[0] >> shift & kUnitMask;
    raw[1] = raw[1] >> shift & kUnitMask;
  }

  // Every step's rows are new sectors (64 rows on), most of them not yet in L2: one thread
  // per row pair (the first warp's: consumer 0's, all 64 rows) asks L2 for the rows of the
  // step `steps_on` steps past the cursor's, kPrefetchSteps steps before their loads, so
  // the loads meet L2's latency, not DRAM's.
  static constexpr int kPrefetchSteps = 16;
  __device__ __forceinline__ void prefetch(int steps_on, bool valid, int thread) const {
    if (valid && thread < 32) {
      const Unit* at = cursor + steps_on * 64 * next_row;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(at + next_row));
    }
  }

  // The step's words: rows n and n + 1 of the first block, then (two tiles) of the second
  // (a 16-bit load holds the two blocks' bytes; its bytes 2 and 3 are zero); then into a
  // stage's scale area.
  __device__ __forceinline__ static void words(const uint32_t (&raw)[2], uint32_t (&out)[kWords]) {
    if constexpr (kOneTile) {
      out[0] = mxfp4::scale_word(raw[0] | raw[1] << 8);
    } else {
      out[0] = mxfp4::scale_word(mxfp4::prmt(raw[0], raw[1], 0x3240u));
      out[1] = mxfp4::scale_word(mxfp4::prmt(raw[0], raw[1], 0x3251u));
    }
  }
  __device__ __forceinline__ void store(uint32_t scale_area,
                                        const uint32_t (&words)[kWords]) const {
    const uint32_t at = scale_area + store_offset;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(words[0]) : "memory");
    if constexpr (!kOneTile)
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(at + 128), "r"(words[1]) : "memory");
  }
};

template <class C>
__device__ __forceinline__ void stream_produce(const WeightStreamParams& p,
                                               const StreamStorage<C>& smem, int thread) {
  constexpr int kAhead = C::kScaleStepsAhead;
  const typename C::Schedule schedule(p);
  StreamRing<C> ring(smem);
  const bool issues_copies = thread == 0;
  for (int t = blockIdx.x; t < schedule.num_tiles(); t += gridDim.x) {
    const StreamTile tile = schedule.tile(t);
    if (tile.rows == 0) continue;
    const int2 segment = stream_segment_steps<C>(p, tile);
    const int base_steps = C::kSegmentEveryTile || !tile.extra ? p.base_steps : 0;
    // The chunk's pool tile: all of it, or (wide) the rows its MMAs read (its data rows
    // rounded up to their width) in boxes of 64.
    const int pool_boxes =
        C::kWide ? stream_wide_width(tile.rows, typename C::MmaWidths{}) / kStreamWideRowsPerBox
                 : 1;
    const uint32_t pool_bytes =
        C::kWide ? pool_boxes * kStreamWideRowsPerBox * kRowBytes : C::kBBytes;
    auto load_pool = [&](uint64_t* bar, int column) {
      if constexpr (C::kWide) {
        for (int box = 0; box < pool_boxes; ++box)
          cute::SM90_TMA_LOAD_2D::copy(&p.pool, bar, kCacheHint,
                                       smem.b(ring.stage) + box * kStreamWideRowsPerBox * kRowBytes,
                                       column, tile.row0 + box * kStreamWideRowsPerBox);
      } else {
        cute::SM90_TMA_LOAD_2D::copy(&p.pool, bar, kCacheHint, smem.b(ring.stage), column,
                                     tile.row0);
      }
    };
    for (int step = segment.x; step < segment.y; ++step) {
      wait_barrier(ring.empty(), ring.phase ^ 1u);
      uint64_t* bar = &smem.full[ring.stage];
      if (issues_copies) {
        // Gated: b1 (then b3) rows 64 j.. at h columns n0..; Store: a2 rows 64 j.. (K)
        // at extra columns 128 half..; StoreMN: lo (then hi) columns 64 j.. (K) at rows
        // 64 wg..; ActivationBackward: a2 columns 64 j.. (K) at the rows of tile `half`
        // of consumer wg's 128 I columns; against the pool's side columns or its K.
        TransactionBarrier::arrive_and_expect_tx(bar, C::kSideBytes + pool_bytes);
        uint8_t* a = smem.a(ring.stage);
        const int half = step >= p.segment_half ? 1 : 0;
        const int j = step - half * p.segment_half;
        const CUtensorMap* map =
            (C::kGated || C::kTransposed) && half ? &p.segment_hi : &p.segment_lo;
        // Store: the extra block's columns (n0 - N on), a half's 128 apart.
        const int column0 = C::kGated ? tile.n0 : tile.n0 - p.weight_rows + 128 * half;
        const int pool_column = C::kGated        ? p.k_base + half * p.side_rank + kBlockK * j
                                : C::kActivation ? p.k_base + kBlockK * j
                                : C::kTransposed ? half * p.segment_k_hi + kBlockK * j
                                                 : kBlockK * j;
#pragma unroll
        for (int wg = 0; wg < C::kSideBytes / kBoxBytes; ++wg) {
          if constexpr (C::kActivation)  // the 5-D view's row pairs: expert, tile, consumer
            cute::SM90_TMA_LOAD_5D::copy(map, bar, kCacheHint, a + wg * kBoxBytes, kBlockK * j, 0,
                                         0, 0,
                                         (tile.expert * p.out_columns + tile.n0 + 128 * wg) / 2);
          else if constexpr (C::kTransposed)
            cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint, a + wg * kBoxBytes, kBlockK * j,
                                         64 * wg, tile.expert);
          else
            cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheHint, a + wg * kBoxBytes,
                                         column0 + 64 * wg, kBlockK * j, tile.expert);
        }
        load_pool(bar, pool_column);
      }
      arrive_barrier(ring.full);
      ring.advance();
    }
    // The base steps with a scale loader (`rows`, taken by value: its cursors move).
    auto run_base_steps = [&](auto rows) {
      using ScaleLoads = decltype(rows);
      constexpr int kLoads = ScaleLoads::kLoads, kWords = ScaleLoads::kWords;
      static_assert(!ScaleLoads::kStaged || ScaleLoads::kSlots == kAhead, "a slot per step ahead");
      uint32_t pending[kAhead][kLoads];  // the scale bytes of the next kAhead base steps
      if constexpr (ScaleLoads::kChunked) {
        static_assert(ScaleLoads::kChunkSteps == kAhead, "a step's place in its chunk is d");
        rows.start(base_steps);
      } else {
#pragma unroll
        for (int d = 0; d < kAhead; ++d) {
          if constexpr (ScaleLoads::kStaged)
            rows.issue(d < base_steps, d);
          else
            rows.load_next(d < base_steps, pending[d]);
        }
      }
      constexpr int kPrefetch = ScaleLoads::kPrefetchSteps;
      for (int d = 0; d < kPrefetch; ++d) rows.prefetch(d, kAhead + d < base_steps, thread);
      // A base step: its words from the pairs loaded kAhead steps before, formed before
      // those registers take the loads of kAhead steps on (formed after, the loads went to
      // temporaries copied back within the step, so every step waited for the loads it had
      // just issued), then the stage's copies and words.
      auto base_step = [&](int k_step, int slot, uint32_t (&pairs)[kLoads]) {
        uint32_t words[kWords];
        if constexpr (ScaleLoads::kStaged)
          rows.take(slot, pairs);
        else if constexpr (ScaleLoads::kChunked)
          rows.take(k_step, slot, pairs);
        rows.words(pairs, words);
        if constexpr (ScaleLoads::kStaged)
          rows.issue(k_step + kAhead < base_steps, slot);
        else if constexpr (ScaleLoads::kChunked)
          rows.refill(k_step, slot, base_steps);
        else
          rows.load_next(k_step + kAhead < base_steps, pairs);
        rows.prefetch(kPrefetch - 1, k_step + kAhead + kPrefetch < base_steps, thread);
        wait_barrier(ring.empty(), ring.phase ^ 1u);
        uint64_t* bar = &smem.full[ring.stage];
        if (issues_copies) {
          TransactionBarrier::arrive_and_expect_tx(bar, C::kCodeBytes + pool_bytes);
          uint8_t* a = smem.a(ring.stage);
          if constexpr (C::kGated)
            cute::SM90_TMA_LOAD_4D::copy(&p.codes, bar, kCacheHint, a, k_step * (kBlockK / 2),
                                         tile.n0, 0, tile.expert);
          else if constexpr (C::kTransposed)
            cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, tile.n0 / 2,
                                         k_step * kBlockK, tile.expert);
          else
            cute::SM90_TMA_LOAD_3D::copy(&p.codes, bar, kCacheHint, a, k_step * (kBlockK / 2),
                                         tile.n0, tile.expert);
          load_pool(bar, k_step * kBlockK);
        }
        rows.store(ring.scale_words(), words);
        arrive_barrier(ring.full);  // release: the words are visible to the consumers' acquire
        ring.advance();
      };
      for (int k_step = 0; k_step < base_steps; k_step += kAhead) {
#pragma unroll
        for (int d = 0; d < kAhead; ++d)
          if (k_step + d < base_steps) base_step(k_step + d, d, pending[d]);
      }
    };
    if constexpr (C::kTransposed) {
      run_base_steps(StreamScaleColumns<C::kOneTile, C::kColumns>(
          p, tile, thread, shared_address(smem.scale_staging)));
    } else if constexpr (C::kOneTile) {
      run_base_steps(StreamScaleLines<C::kGated>(p, tile, thread));
    } else if (p.k_base % StreamScaleRowChunks::kChunkK == 0) {
      run_base_steps(StreamScaleRowChunks(p, tile, thread));  // rows of whole chunks
    } else {
      run_base_steps(StreamScaleRows(p, tile, thread));
    }
  }
}

}  // namespace megamoe::kernels::engine
