/* csrc/attention.h's forward and backward over contiguous [B, H, S, D] operands, without ORT:
 * tests/test_instruction_sets.py builds it for each instruction set the header has a path for
 * (AVX-512, AVX2, generic vectors) and calls it through ctypes. */
#include "attention.h"

static PwAttention problem(int64_t B, int64_t H, int64_t M, int64_t N, int64_t D, float* q, float* k, float* v) {
  const int64_t qd[4] = {B, H, M, D}, kd[4] = {B, H, N, D};
  PwAttention a = {0};
  a.q = pw_att_operand(q, qd, 0);
  a.k = pw_att_operand(k, kd, 0);
  a.v = pw_att_operand(v, kd, 0);
  a.heads = H, a.kv_heads = H, a.group = 1, a.M = M, a.N = N, a.items_per_task = 1;
  return a;
}

__attribute__((visibility("default"))) void attention_forward(int64_t B, int64_t H, int64_t M, int64_t N, int64_t D,
                                                              int causal, float scale, float* q, float* k, float* v,
                                                              float* out, float* lse) {
  PwAttention a = problem(B, H, M, N, D, q, k, v);
  const int64_t qd[4] = {B, H, M, D};
  a.y = pw_att_operand(out, qd, 0);
  a.y_lse = lse;
  a.blocks = (M + PW_ATT_ROWS - 1) / PW_ATT_ROWS;
  a.items = B * H * a.blocks;
  for (int64_t t = 0; t < a.items; ++t) pw_att_task(&a, (size_t)t, 0, (int)D, causal, 0, scale);
}

__attribute__((visibility("default"))) void attention_backward(int64_t B, int64_t H, int64_t M, int64_t N, int64_t D,
                                                               int causal, float scale, float* q, float* k, float* v,
                                                               float* grad, float* out, float* lse, float* gq,
                                                               float* gk, float* gv) {
  PwAttention a = problem(B, H, M, N, D, q, k, v);
  const int64_t qd[4] = {B, H, M, D}, kd[4] = {B, H, N, D};
  a.grad = pw_att_operand(grad, qd, 0);
  a.out = pw_att_operand(out, qd, 0);
  a.lse = lse;
  a.gq = pw_att_operand(gq, qd, 0);
  a.gk = pw_att_operand(gk, kd, 0);
  a.gv = pw_att_operand(gv, kd, 0);
  a.blocks = 1;
  a.items = B * H;
  for (int64_t t = 0; t < a.items; ++t) pw_att_task(&a, (size_t)t, 1, (int)D, causal, 0, scale);
}

/* Which of attention.h's paths this build took: 512 (AVX-512), 256 (AVX2), 0 (generic). */
__attribute__((visibility("default"))) int attention_path(void) {
#if defined(__AVX512F__)
  return 512;
#elif defined(PW_ATT_AVX2)
  return 256;
#else
  return 0;
#endif
}
