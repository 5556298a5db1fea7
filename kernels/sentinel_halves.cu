// The SENTINEL kernels' send and receive halves (ep_a2a/halves.py): sentinel.cu's code in a cubin of
// its own, so that the whole kernels' translation unit, and so their register allocation,
// does not depend on the halves.
#define EP_HALVES
#include "sentinel.cu"
