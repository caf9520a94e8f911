// Sample template-heavy kernel: CUB's block radix sort, block scan and block histogram of
// one tile, through a compile-time list of key types (each instantiates its own chain of
// CUB templates), as the template-heavy kernels of JIT libraries do. Each block sorts its
// 512 keys, prefix-sums them and counts them into 64 bins.
#include <cub/block/block_histogram.cuh>
#include <cub/block/block_load.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/block/block_store.cuh>
#include <cuda/std/tuple>
#include <cuda/std/type_traits>

template <typename Key, int Threads, int Items>
struct Tile {
	using Load = cub::BlockLoad<Key, Threads, Items, cub::BLOCK_LOAD_TRANSPOSE>;
	using Sort = cub::BlockRadixSort<Key, Threads, Items>;
	using Scan = cub::BlockScan<Key, Threads>;
	using Store = cub::BlockStore<Key, Threads, Items, cub::BLOCK_STORE_TRANSPOSE>;
	using Hist = cub::BlockHistogram<unsigned char, Threads, Items, 64>;
	union Storage {
		typename Load::TempStorage load;
		typename Sort::TempStorage sort;
		typename Scan::TempStorage scan;
		typename Store::TempStorage store;
		typename Hist::TempStorage hist;
	};

	static __device__ void run(Storage &tmp, const Key *in, Key *out, unsigned *bins)
	{
		Key keys[Items];
		unsigned char bytes[Items];
		const int base = blockIdx.x * Threads * Items;
		Load(tmp.load).Load(in + base, keys);
		__syncthreads();
		Sort(tmp.sort).Sort(keys);
		__syncthreads();
		Scan(tmp.scan).InclusiveSum(keys, keys);
		__syncthreads();
		for (int i = 0; i < Items; i++)
			bytes[i] = static_cast<unsigned char>(static_cast<unsigned long long>(keys[i]) & 63);
		Hist(tmp.hist).Histogram(bytes, bins);
		__syncthreads();
		Store(tmp.store).Store(out + base, keys);
	}
};

template <typename... Keys>
struct Tiles {
	using Tuple = cuda::std::tuple<Keys...>;
	template <int I, typename Key = cuda::std::tuple_element_t<I, Tuple>>
	static __device__ void one(const void *in, void *out, unsigned *bins)
	{
		using T = Tile<Key, 128, 4>;
		__shared__ typename T::Storage tmp;
		T::run(tmp, static_cast<const Key *>(in), static_cast<Key *>(out), bins + I * 64);
	}
	template <int I = 0>
	static __device__ void all(int which, const void *in, void *out, unsigned *bins)
	{
		if constexpr (I < static_cast<int>(sizeof...(Keys))) {
			if (which == I)
				one<I>(in, out, bins);
			else
				all<I + 1>(which, in, out, bins);
		}
	}
};

extern "C" __global__ void tile_sort(int which, const void *in, void *out, unsigned *bins)
{
	Tiles<int, unsigned, long long, unsigned long long, short, unsigned short>::all(which, in,
											 out, bins);
}
