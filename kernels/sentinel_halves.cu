// The SENTINEL kernels' send and receive halves (ep_a2a/halves.py): sentinel.cu's code, built
// in a cubin of their own so that the whole kernels' translation unit, and so their register
// allocation, is the one they had before the halves existed.
#define EP_HALVES
#include "sentinel.cu"
