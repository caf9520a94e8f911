// Sample kernel that does not compile: the compiler rejects it.
extern "C" __global__ void broken(float *out)
{
	out[threadIdx.x] = undefined_symbol_kcachefs_test;
}
