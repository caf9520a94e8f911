// Sample kernel: y[i] = alpha * x[i] + y[i].
extern "C" __global__ void saxpy(float alpha, const float *x, float *y, int n)
{
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
		y[i] = alpha * x[i] + y[i];
}
