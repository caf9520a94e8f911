// Sample kernel that includes CCCL/CUB headers: a compile takes seconds, like the
// template-heavy kernels of JIT libraries. out[blockIdx.x] = sum of 256 ints of the block.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_load.cuh>

extern "C" __global__ void block_sum(const int *in, int *out)
{
	using Load = cub::BlockLoad<int, 128, 2, cub::BLOCK_LOAD_DIRECT>;
	using Reduce = cub::BlockReduce<int, 128>;
	__shared__ union {
		typename Load::TempStorage load;
		typename Reduce::TempStorage reduce;
	} tmp;
	int items[2];
	Load(tmp.load).Load(in + blockIdx.x * 256, items);
	__syncthreads();
	int total = Reduce(tmp.reduce).Sum(items);
	if (threadIdx.x == 0)
		out[blockIdx.x] = total;
}
