// One K step's TMA loads into a stage, alone or shared by a cluster pair.
//
// A 2x1 cluster computes M blocks 2j and 2j + 1 against the same B tile when both lie in
// one expert (tile_scheduler.cuh): then each CTA loads every other copy of the B tile
// and multicasts it into both CTAs' stages, so L2 serves each B tile once per pair
// instead of once per CTA. The copies land at the same shared-memory offsets in both
// CTAs and count their bytes on the same `full` barrier of each, which is why each CTA
// still arms its barrier with the whole stage's bytes. Every other load (A; B when the
// pair straddles two experts; an unclustered launch) is the CTA's own.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90_tma.hpp>

#include "pipeline.cuh"

namespace megamoe::kernels::engine {

// This CTA's rank in its cluster and the cluster's CTA count (1 without a cluster launch):
// special registers, read again where needed rather than held in registers.
__device__ __forceinline__ int cluster_rank() {
  return static_cast<int>(__clusterRelativeBlockRank());
}
__device__ __forceinline__ int cluster_size() { return static_cast<int>(__clusterSizeInBlocks()); }

// The cute TMA load of a `Dims`-dimensional map, alone and multicast.
template <int Dims>
struct TmaLoadOps;
template <>
struct TmaLoadOps<2> {
  using Load = cute::SM90_TMA_LOAD_2D;
  using Multicast = cute::SM90_TMA_LOAD_MULTICAST_2D;
};
template <>
struct TmaLoadOps<3> {
  using Load = cute::SM90_TMA_LOAD_3D;
  using Multicast = cute::SM90_TMA_LOAD_MULTICAST_3D;
};
template <>
struct TmaLoadOps<4> {
  using Load = cute::SM90_TMA_LOAD_4D;
  using Multicast = cute::SM90_TMA_LOAD_MULTICAST_4D;
};

class StageLoad {
 public:
  // `shared`: the pair shares this stage's B tile (ranks 0 and 1 of a 2-CTA cluster).
  __device__ __forceinline__ StageLoad(uint64_t* full, bool shared, int rank)
      : full_(full), shared_(shared), rank_(rank) {}

  // The CTA's own copy (the A operand).
  template <class... Coords>
  __device__ __forceinline__ void own(const CUtensorMap* map, uint8_t* dst, Coords... coords) const {
    TmaLoadOps<sizeof...(Coords)>::Load::copy(map, full_, kCacheHint, dst, coords...);
  }

  // A copy of the B tile: issued by one rank of a sharing pair, for both CTAs.
  template <class... Coords>
  __device__ __forceinline__ void b(const CUtensorMap* map, uint8_t* dst, Coords... coords) {
    if (!shared_) {
      own(map, dst, coords...);
      return;
    }
    if ((copies_++ & 1) != rank_) return;
    constexpr uint16_t kBothCtas = 0b11;
    TmaLoadOps<sizeof...(Coords)>::Multicast::copy(map, full_, kBothCtas, kCacheHint, dst, coords...);
  }

 private:
  uint64_t* full_;
  bool shared_;
  int rank_;
  int copies_ = 0;
};

// A consumer warp's release of a stage it read: with a cluster pair, both CTAs' `empty`
// barriers, since each CTA's producer multicasts into the other's stage.
__device__ __forceinline__ void release_stage(uint64_t* empty, bool pair, int lane) {
  if (lane != 0) return;
  if (pair) {
    Barrier::arrive(empty, 0u, 1u);
    Barrier::arrive(empty, 1u, 1u);
  } else {
    Barrier::arrive(empty);
  }
}

}  // namespace megamoe::kernels::engine
