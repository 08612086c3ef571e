/* Time ibsum.h's pi_ib_matmul (the input-block prefill GEMM) alone, in C, for one build of the
 * headers (so AVX2 and VNNI builds of two trees can be compared without building the package):
 *
 *   gcc -O3 -fno-strict-aliasing -mavx2 -mfma -mf16c [-mavx512f -mavx512bw -mavx512vnni
 *       -mavx512vl] -fopenmp -I TREE/cython -o ib_bench tools/ib_matmul_bench.c -lm
 *   ./ib_bench N_OUT N_IN N_TOK THREADS [4]      (4: q4_0, else q8_0)
 *
 * Random weights (every scale 1.0), inputs 0 with probability 0.3, the same for every build
 * (rand() unseeded); prints the best of 20 calls in ms and the dense multiply-adds per second.
 * The weights stay in cache across the calls (tools/ab_ib_prefill.py streams a file's 30 layers).
 */
#include "simd.h"
#include "rowsum_team.h"
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int n_out=atoi(argv[1]), n_in=atoi(argv[2]), ntok=atoi(argv[3]), th=atoi(argv[4]);
  int q=(argc>5 && argv[5][0]=='4')?PI_Q4_0_IB:PI_Q8_0_IB; size_t stride=pi_ib_block_bytes(q,n_out); long nb=n_in/32;
  uint8_t*w=malloc(stride*nb); for(size_t i=0;i<stride*nb;i++) w[i]=rand();
  uint16_t one=0x3c00; for(long b=0;b<nb;b++) for(int i=0;i<n_out;i++) memcpy(w+stride*b+2*i,&one,2);
  float*a=malloc(4L*ntok*n_in),*o=malloc(4L*ntok*n_out);
  for(long i=0;i<(long)ntok*n_in;i++) a[i]=(rand()%10<3)?0.f:(rand()/(float)RAND_MAX-0.5f);
  double best=1e9; for(int r=0;r<20;r++){double t0=now(); pi_ib_matmul(q,w,stride,n_in,a,n_in,ntok,o,n_out,n_out,th); double t=now()-t0; if(t<best)best=t;}
  printf("%s %dx%d tok=%d th=%d: %.3f ms  %.1f GMAC/s\n",q==PI_Q8_0_IB?"q8_0":"q4_0",n_out,n_in,ntok,th,best*1e3,(double)ntok*n_out*n_in/best/1e9);
}
