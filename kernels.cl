// kernels.cl — every OpenCL kernel netcl runs, in OpenCL C 1.2.
//
// The sections are netcl.py's, in its order, and so are the sub-sections, under the same
// banners, so the two files can be read side by side. Each kernel sits in the sub-section of
// the netcl.py function that launches it (but for the tensor-core probe, kept beside the
// kernels it vouches for, and the elementwise add that the tensor helpers' gradient sum
// launches too), and a section or sub-section without kernels is left out: device & kernels
// (the two builds) -> Tensor (tensor helpers: casts, sums along an axis, the work-group
// reductions) -> autograd (gradient accumulation) -> operations (integer promotion,
// elementwise, matrix products, shape ops, reductions, softmax and losses, convolution and
// pooling, dropout, normalisation, embedding and attention) -> optimizers -> mixed precision.
// A helper sits in the first sub-section that uses it: OpenCL C wants a function defined
// before its first call.
//
// Conventions:
// - Every kernel takes its sizes first, then runtime scalars, then buffers; a shape comment
//   such as `x (rows, cols)` gives each buffer's logical layout. All tensors are C-contiguous.
// - Runtime scalars are arguments, never baked into the source: one build serves every call.
// - 1-D kernels guard `i < n`: the host rounds the global size up to a multiple of the fixed
//   local size (a new local size is a new compile on some drivers, PoCL among them).
// - Built without -cl-fast-relaxed-math / -cl-finite-math-only so NaN and Inf stay IEEE.
//
// Two builds of this one source per device, with HALF_STORAGE=0 and HALF_STORAGE=1 (netcl.py:
// Device.launch(..., half=True) picks the second). `act_t` is the storage type of
// activations, the values a forward pass writes and keeps for backward: float, or half in the
// half build, used for float16 storage under autocast. Half values are only loaded and stored,
// with vload_half / vstore_half (core OpenCL 1.2), never computed with: many devices, NVIDIA's
// among them, have no cl_khr_fp16. All arithmetic is float in both builds. The gradient of an
// activation is act_t where a backward kernel says so (the elementwise ops', pooling's,
// col2im's dx); weights, their gradients, optimizer state and the outputs of reductions,
// softmax and losses are always float.
// In the float build act_t is float and LOAD/STORE are plain accesses: that build is exactly
// the float32 library. Each kernel says which of its buffers are act_t; a kernel has the same
// name and arguments in both builds.

// ============================================================================ device & kernels
#ifndef HALF_STORAGE
#define HALF_STORAGE 0
#endif
#ifndef TENSOR_CORES  // 1 only in the half build, on a device whose tensor-core probe passed
#define TENSOR_CORES 0
#endif
#ifndef CPU_DEVICE  // 1 on CPU devices (PoCL): see the gradient norms' loops
#define CPU_DEVICE 0
#endif
#ifndef WINOGRAD  // 1 where conv2d's Winograd kernels fit: 48 KiB of local memory, 512 work-items
#define WINOGRAD 0
#endif
#ifndef PANEL_ROWS  // the packed GEMM's block of C on CPU devices (see there): 6x16 or 12x32
#define PANEL_ROWS 6
#endif
#ifndef PANEL_COLS
#define PANEL_COLS 16
#endif
#ifdef cl_khr_fp64  // double is used in one place: the loss scale's reciprocal (AMP section)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
#if HALF_STORAGE
typedef half act_t;
#define LOAD(p, i) vload_half((i), (p))
#define STORE(p, i, v) vstore_half((v), (i), (p))  // rounds to nearest even; overflow -> inf
#else
typedef float act_t;
#define LOAD(p, i) ((p)[i])
#define STORE(p, i, v) ((p)[i] = (v))
#endif

// ============================================================================ Tensor
// --- tensor helpers --------------------------------------------------------------------------
// Casts between float16 storage and float32, for operands that must change storage: in the
// half build cast_to_act rounds to half (nearest even, overflow to inf) and cast_from_act
// widens exactly; in the float build both are copies. x, out (n).
__kernel void cast_to_act(const int n, __global const float* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) STORE(out, i, x[i]);
}

__kernel void cast_from_act(const int n, __global const act_t* x, __global float* out) {
    const int i = get_global_id(0);
    if (i < n) out[i] = LOAD(x, i);
}

// x (outer, R, inner) -> out (outer, inner) = scale * sum over R
__kernel void sum_axis(const int outer, const int R, const int inner, const float scale,
                       __global const act_t* x, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    const int o = i / inner, in = i % inner;
    __global const act_t* row = x + o * R * inner + in;
    float acc = 0.0f;
    for (int r = 0; r < R; ++r) acc += LOAD(row, r * inner);
    out[i] = scale * acc;
}

// The same sum for few long columns (a bias gradient: inner the features, R the rows), in
// one launch where sum_axis's one work-item per column would leave a GPU idle: a work-group
// of COLUMN_LANES x COLUMN_LANES work-items takes that many adjacent columns (adjacent
// work-items read adjacent elements, so loads coalesce), each of its lanes summing every
// COLUMN_LANES-th row, then a tree over the lanes in local memory. Grid (columns, lanes,
// outer).
#define COLUMN_LANES 16

// The tree over the lanes of a COLUMN_LANES x COLUMN_LANES work-group: partial[lane][c]
// becomes the sum over lanes in partial[0][c]. Padded rows avoid local-memory bank conflicts.
void sum_over_lanes(__local float (*partial)[COLUMN_LANES + 1], const int lane, const int c) {
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = COLUMN_LANES / 2; stride > 0; stride >>= 1) {
        if (lane < stride) partial[lane][c] += partial[lane + stride][c];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

__kernel __attribute__((reqd_work_group_size(COLUMN_LANES, COLUMN_LANES, 1)))
void sum_columns(const int R, const int inner, const float scale, __global const act_t* x,
                 __global float* out) {
    __local float partial[COLUMN_LANES][COLUMN_LANES + 1];
    const int col = get_global_id(0), c = get_local_id(0), lane = get_local_id(1);
    const int o = get_global_id(2);
    float acc = 0.0f;
    if (col < inner) {
        __global const act_t* column = x + o * R * inner + col;
        for (int r = lane; r < R; r += COLUMN_LANES) acc += LOAD(column, r * inner);
    }
    partial[lane][c] = acc;
    sum_over_lanes(partial, lane, c);
    if (lane == 0 && col < inner) out[o * inner + col] = scale * partial[0][c];
}

// The larger of a and b, or NaN if either is NaN.
float max_keeping_nan(const float a, const float b) { return (a > b || isnan(a)) ? a : b; }

// The sum (or, with take_max, the maximum, NaN winning) of `value` over the work-group (a
// power of two wide, `partial` as long), returned to every work-item: a tree in local memory,
// in the same order on every device. sum_all, the normalisations, attention and the gradient
// norms all reduce through it.
float group_reduce(__local float* partial, const float value, const int take_max) {
    const int lid = get_local_id(0);
    partial[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = get_local_size(0) / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            const float other = partial[lid + stride];
            partial[lid] = take_max ? max_keeping_nan(partial[lid], other) : partial[lid] + other;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float result = partial[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // partial may be reused once every work-item has read it
    return result;
}

float group_sum(__local float* partial, const float value) {
    return group_reduce(partial, value, 0);
}

// x (outer, R) -> out (outer) = scale * the sum of each row: one 256-wide work-group per row
// (adjacent work-items read adjacent elements), for long rows on GPUs (a convolution's bias
// gradient sums rows of OH * OW), where sum_axis's one work-item per row reads uncoalesced.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void sum_rows(const int R, const float scale, __global const act_t* x, __global float* out) {
    __local float partial[256];
    __global const act_t* row = x + get_group_id(0) * R;
    float acc = 0.0f;
    for (int i = get_local_id(0); i < R; i += 256) acc += LOAD(row, i);
    const float total = group_sum(partial, acc);
    if (get_local_id(0) == 0) out[get_group_id(0)] = scale * total;
}

// x (n) -> out (groups) = scale * partial sums, one per 256-wide work-group; run once more
// on the partials when there is more than one group.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void sum_all(const int n, const float scale, __global const act_t* x, __global float* out) {
    __local float partial[256];
    float acc = 0.0f;
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) acc += LOAD(x, i);
    const float total = group_sum(partial, acc);
    if (get_local_id(0) == 0) out[get_group_id(0)] = scale * total;
}

// ============================================================================ autograd

// dst (n) += alpha * src (n), in place: a leaf's .grad accumulating a second backward pass,
// a convolution's weight gradient summed over chunks, the Trainer's epoch loss.
__kernel void accumulate(const int n, const float alpha, __global float* dst,
                         __global const float* src) {
    const int i = get_global_id(0);
    if (i < n) dst[i] += alpha * src[i];
}

// ============================================================================ operations
// x (n) int32 -> out (n) act_t: an integer operand promoted to floating point, as PyTorch
// promotes it (rounding to nearest even beyond 2^24, and to half in the half build).
__kernel void int_to_act(const int n, __global const int* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) STORE(out, i, (float)x[i]);
}

// --- elementwise, one input ------------------------------------------------------------------
// out (n) = f(x, alpha). alpha is the op's scalar (a slope, a constant operand), unused by
// most. x and out are activations (act_t).
#define UNARY(NAME, EXPR)                                                               \
__kernel void NAME(const int n, const float alpha,                                      \
                   __global const act_t* x_, __global act_t* out) {                     \
    const int i = get_global_id(0);                                                     \
    if (i < n) { const float x = LOAD(x_, i); STORE(out, i, (EXPR)); }                  \
}

UNARY(neg_fwd, -x)
UNARY(relu_fwd, (x > 0.0f || isnan(x)) ? x : 0.0f)        // NaN propagates, as PyTorch
UNARY(leaky_relu_fwd, x > 0.0f ? x : x * alpha)
UNARY(sigmoid_fwd, 1.0f / (1.0f + exp(-x)))
// tanh rounds to +-1 in float32 once 1 - |tanh(x)| ~ 2 exp(-2|x|) < 2^-25, i.e. |x| > 13 ln 2;
// some devices' tanh (PoCL's) stays at +-0.99999994 there, up to inf. NaN fails the test.
UNARY(tanh_fwd, fabs(x) > 9.010913f ? copysign(1.0f, x) : tanh(x))
UNARY(gelu_fwd, 0.5f * x * (1.0f + erf(x * M_SQRT1_2_F)))  // exact (erf) GELU, PyTorch default
UNARY(exp_fwd, exp(x))
UNARY(log_fwd, log(x))
UNARY(add_scalar, x + alpha)
UNARY(mul_scalar, x * alpha)
UNARY(div_scalar, x / alpha)
UNARY(rsub_scalar, alpha - x)
UNARY(rdiv_scalar, alpha / x)
UNARY(sqrt_fwd, sqrt(x))
UNARY(rsqrt_fwd, 1.0f / sqrt(x))  // not rsqrt(), which OpenCL allows 2 ulps: PyTorch divides
UNARY(abs_fwd, fabs(x))
UNARY(pow_fwd, pow(x, alpha))     // alpha = the exponent
UNARY(silu_fwd, x / (1.0f + exp(-x)))

// PyTorch's tanh GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), is x s for
// s = (1 + tanh(u)) / 2 = sigmoid(2u): through exp, 1 + tanh(u) keeps its precision where
// tanh(u) is close to -1, which the sum itself would cancel.
float gelu_tanh_s(const float x) {
    return 1.0f / (1.0f + exp(-1.5957691216f * (x + 0.044715f * x * x * x)));
}

// d(x s)/dx: PyTorch's 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, with 1 - t^2 = 4 s (1 - s)
float gelu_tanh_slope(const float x) {
    const float s = gelu_tanh_s(x);
    return s + 2.0f * x * s * (1.0f - s) * 0.7978845608f * (1.0f + 0.134145f * x * x);
}

UNARY(gelu_tanh_fwd, x * gelu_tanh_s(x))

// Their gradients: out (n) = dL/dx from g = dL/dout and s, the saved input x or output y.
// All three are act_t: the gradient of a float16 activation is float16 storage too.
#define UNARY_GRAD(NAME, EXPR)                                                          \
__kernel void NAME(const int n, const float alpha, __global const act_t* g_,            \
                   __global const act_t* s_, __global act_t* out) {                     \
    const int i = get_global_id(0);                                                     \
    if (i < n) { const float g = LOAD(g_, i), s = LOAD(s_, i); STORE(out, i, (EXPR)); } \
}

UNARY_GRAD(relu_bwd, s <= 0.0f ? 0.0f : g)                     // s = y: NaN passes g, as PyTorch
UNARY_GRAD(leaky_relu_bwd, s > 0.0f ? g : g * alpha)           // s = x
UNARY_GRAD(sigmoid_bwd, g * s * (1.0f - s))                    // s = y
UNARY_GRAD(tanh_bwd, g * (1.0f - s * s))                       // s = y
UNARY_GRAD(gelu_bwd, g * (0.5f * (1.0f + erf(s * M_SQRT1_2_F)) // s = x: Phi(x) + x phi(x)
                          + s * 0.3989422804014327f * exp(-0.5f * s * s)))
UNARY_GRAD(exp_bwd, g * s)                                     // s = y
UNARY_GRAD(log_bwd, g / s)                                     // s = x
UNARY_GRAD(rdiv_bwd, -alpha * g / (s * s))                     // s = x, d(alpha/x)/dx
UNARY_GRAD(sqrt_bwd, g / (2.0f * s))                           // s = y
UNARY_GRAD(rsqrt_bwd, -0.5f * g * s * s * s)                   // s = y
UNARY_GRAD(abs_bwd, g * sign(s))                               // s = x: sign(0) = sign(NaN) = 0
UNARY_GRAD(pow_bwd, alpha == 0.0f ? 0.0f                       // s = x; 0 for exponent 0, as
                                  : g * alpha * pow(s, alpha - 1.0f))  // PyTorch's pow_backward
UNARY_GRAD(silu_bwd, g / (1.0f + exp(-s))                     // s = x: g sigmoid(x) (1 + x
                         * (1.0f + s * (1.0f - 1.0f / (1.0f + exp(-s)))))  // (1 - sigmoid(x)))
UNARY_GRAD(gelu_tanh_bwd, g * gelu_tanh_slope(s))              // s = x

// clamp: out (n) = x limited to [low, high] (-inf / inf for an absent bound); NaN stays NaN.
// fmin(fmax(x, low), high) gives high everywhere when low > high, as torch.clamp.
__kernel void clamp_fwd(const int n, const float low, const float high,
                        __global const act_t* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) {
        const float v = LOAD(x, i);
        STORE(out, i, isnan(v) ? v : fmin(fmax(v, low), high));
    }
}

// dL/dx (n) = g where low <= x <= high (the bounds pass the gradient, as PyTorch's), else 0;
// g, x and out act_t
__kernel void clamp_bwd(const int n, const float low, const float high, __global const act_t* g,
                        __global const act_t* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) {
        const float v = LOAD(x, i);
        STORE(out, i, (v >= low && v <= high) ? LOAD(g, i) : 0.0f);
    }
}

// --- elementwise, two inputs -----------------------------------------------------------------
// out (n) = f(a, b), the operands broadcast as in NumPy.
// a, b and out are act_t (netcl.py widens a float16 operand met with a float32 one).
// NAME_fwd: both operands hold out's n elements in out's order (no index arithmetic).
// NAME_bcast: broadcast_t maps out's index to each operand's. netcl.py (_broadcast) sees out as
// groups of adjacent dimensions along which the same operand repeats (a bias row against
// x (rows, cols) is 2 groups, (rows) and (cols)); an operand's stride is 0 along a group it
// repeats.
#define BROADCAST_RANK 8  // netcl.py: _BROADCAST_RANK
typedef struct {
    int ndim;                       // groups in use, outermost first
    int dims[BROADCAST_RANK];       // out's size along each group
    int a_strides[BROADCAST_RANK];  // a's stride in elements along each group
    int b_strides[BROADCAST_RANK];
} broadcast_t;

// The offsets in a (.x) and b (.y) of out's element i: i's index along each group, innermost
// first, times the operands' strides. Unrolled to BROADCAST_RANK with a guard (a loop to the
// runtime ndim ran at half speed on PoCL); one division per group, none for the outermost.
int2 broadcast_offsets(const broadcast_t plan, int i) {
    int2 offsets = (int2)(0, 0);
    #pragma unroll
    for (int d = BROADCAST_RANK - 1; d > 0; --d) {
        if (d < plan.ndim) {
            const int outer = i / plan.dims[d];
            offsets += (i - outer * plan.dims[d]) * (int2)(plan.a_strides[d], plan.b_strides[d]);
            i = outer;
        }
    }
    return offsets + i * (int2)(plan.a_strides[0], plan.b_strides[0]);  // i < dims[0] here
}

#define BINARY(NAME, EXPR)                                                              \
__kernel void NAME##_fwd(const int n, __global const act_t* a_, __global const act_t* b_,  \
                         __global act_t* out) {                                         \
    const int i = get_global_id(0);                                                     \
    if (i < n) { const float a = LOAD(a_, i), b = LOAD(b_, i); STORE(out, i, (EXPR)); } \
}                                                                                       \
__kernel void NAME##_bcast(const int n, const broadcast_t plan, __global const act_t* a_,  \
                           __global const act_t* b_, __global act_t* out) {             \
    const int i = get_global_id(0);                                                     \
    if (i < n) {                                                                        \
        const int2 at = broadcast_offsets(plan, i);                                     \
        const float a = LOAD(a_, at.x), b = LOAD(b_, at.y);                             \
        STORE(out, i, (EXPR));                                                          \
    }                                                                                   \
}

BINARY(add, a + b)
BINARY(sub, a - b)
BINARY(mul, a * b)
BINARY(div, a / b)

// out (float) = a (float) + b (act_t), n of each: a residual stream in float32 plus a block's
// float16 output under autocast, without widening b in a pass of its own first.
__kernel void add_mixed_fwd(const int n, __global const float* a, __global const act_t* b,
                            __global float* out) {
    const int i = get_global_id(0);
    if (i < n) out[i] = a[i] + LOAD(b, i);
}

// d(a/b)/db = -g a / b^2 at the output's shape: g and out (n), a and b act_t, of out's shape
// (div_bwd_b) or broadcast (div_bwd_b_bcast, plan as for div_bcast).
__kernel void div_bwd_b(const int n, __global const act_t* g, __global const act_t* a,
                        __global const act_t* b, __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) {
        const float bv = LOAD(b, i);
        STORE(out, i, -LOAD(g, i) * LOAD(a, i) / (bv * bv));
    }
}

__kernel void div_bwd_b_bcast(const int n, const broadcast_t plan, __global const act_t* g,
                              __global const act_t* a, __global const act_t* b,
                              __global act_t* out) {
    const int i = get_global_id(0);
    if (i < n) {
        const int2 at = broadcast_offsets(plan, i);
        const float bv = LOAD(b, at.y);
        STORE(out, i, -LOAD(g, i) * LOAD(a, at.x) / (bv * bv));
    }
}

// --- maximum, minimum and selection ----------------------------------------------------------
// BINARY kernels, launched like add's.
BINARY(maximum, (a > b || isnan(a)) ? a : b)  // NaN on either side gives NaN, as PyTorch
BINARY(minimum, (a < b || isnan(a)) ? a : b)
// a's share of the gradient of maximum(a, b): 1 where it won, 0 where it lost, half on a tie
BINARY(max_share, a < b ? 0.0f : (a == b ? 0.5f : 1.0f))
// a is a mask of 1s and 0s: b where it is 1 (pick) or 0 (drop), else -0.0, so that a pick
// plus a drop is exactly a selection (x + -0.0 == x for every x, -0.0 included)
BINARY(where_pick, a != 0.0f ? b : -0.0f)
BINARY(where_drop, a != 0.0f ? -0.0f : b)

// cond (n) int32 -> mask (n) act_t: 1 where cond is nonzero, else 0
__kernel void nonzero_mask(const int n, __global const int* cond, __global act_t* mask) {
    const int i = get_global_id(0);
    if (i < n) STORE(mask, i, cond[i] != 0 ? 1.0f : 0.0f);
}

// --- matrix products -------------------------------------------------------------------------
// GEMM: C (M, N) = op(A) (M, K) @ op(B) (K, N) [+ bias (N)], op = identity or transpose.
// Backward needs A^T B and A B^T; the layout is a macro argument, so no transpose is ever
// materialised. A 16x16 work-group computes a TILE x TILE block of C, TILE = 16 * WPT, each
// work-item a WPT x WPT block of it, staging 16-deep slices of op(A) and op(B) in local
// memory. Out-of-range elements load as zero, so any M, N, K works.
// Operand types are macro arguments too, float or act_t, and accumulation is float: gemm_nn and
// gemm_nt read A and write C as act_t, B (the weight) float (under autocast, the forward
// products); gemm_tn reads B as act_t, A and C float (linear's weight gradient g^T x, from the
// x the forward kept). bias is float.
// - Global loads are coalesced: consecutive work-items read consecutive addresses, along k
//   (K_FAST) or along m/n, whichever is contiguous in the operand's layout.
// - Each work-item owns rows {h*64 + ty*4 + 0..3} and columns {h*64 + tx*4 + 0..3} for
//   h < WPT/4, so it reads its operands from local memory as float4s, and neighbouring
//   work-items read neighbouring float4s (no bank conflicts); rows are padded by 4 floats so
//   the k-fast stores into local memory spread over the banks.
// - Register prefetch: while the work-group multiplies the tile staged in local memory, each
//   work-item already loads its share of the next tile from global memory into registers,
//   so global-memory latency hides behind the arithmetic (+5% on the H200 at n=4096).
// - SPLIT is a compile-time 0 or 1: only the _split kernels carry split-K's bounds. (With
//   them in every kernel, and with the tile loads factored into helper macros, the H200 ran
//   the 128x128 kernels at 21 instead of 28 TFLOP/s: the loads are written out on purpose.)
// WPT = 4 (64x64 tiles) keeps small products spread over many work-groups; WPT = 8 (128x128)
// does twice the arithmetic per local-memory read, for large products. A product with few
// tiles but a long K (a convolution's weight gradient) splits K over the grid's third
// dimension (k_chunk, in the _split kernels); the host then sums the partial products. In
// the other kernels the third dimension is a batch: product z reads A and B batch_a and
// batch_b elements on (0 for a matrix every product shares) and writes the z-th C.
#define TILE_K 16
// The bias a GEMM adds to C[r][c]: has_bias 0: none; 1: bias[c], one per column (linear's);
// 2: bias[r], one per row (conv2d's, an output channel's).
#define BIAS_AT(has_bias, bias, r, c) ((has_bias) ? (bias)[(has_bias) == 2 ? (r) : (c)] : 0.0f)
#define LOAD_float(p, i) ((p)[i])
#define LOAD_act_t(p, i) LOAD(p, i)
#define STORE_float(p, i, v) ((p)[i] = (v))
#define STORE_act_t(p, i, v) STORE(p, i, v)
#define GEMM(NAME, WPT, SPLIT, A_T, A_AT, A_K_FAST, B_T, B_AT, B_K_FAST, C_T)                  \
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))                                      \
void NAME(const int M, const int N, const int K, const int k_chunk, const int batch_a,       \
          const int batch_b, const int has_bias, __global const A_T* A, __global const B_T* B, \
          __global const float* bias, __global C_T* C) {                                       \
    const int TILE = 16 * WPT;                                                                 \
    /* split-K: work-group z multiplies k in [k_begin, k_end) into its own slice of C; else */ \
    /* z is the product's index in a batch, A and B batch_a and batch_b elements apart */      \
    const int k_begin = SPLIT ? get_group_id(2) * k_chunk : 0;                                 \
    const int k_end = SPLIT ? min(K, k_begin + k_chunk) : K;                                   \
    C += get_group_id(2) * M * N;                                                              \
    if (!SPLIT) { A += get_group_id(2) * batch_a; B += get_group_id(2) * batch_b; }            \
    __local float As[TILE_K][16 * WPT + 4];                                                    \
    __local float Bs[TILE_K][16 * WPT + 4];                                                    \
    const int tx = get_local_id(0), ty = get_local_id(1), lid = ty * 16 + tx;                  \
    const int row0 = get_group_id(1) * TILE, col0 = get_group_id(0) * TILE;                    \
    float acc[WPT][WPT], a_next[WPT], b_next[WPT];                                             \
    for (int i = 0; i < WPT; ++i) for (int j = 0; j < WPT; ++j) acc[i][j] = 0.0f;              \
    for (int l = 0; l < WPT; ++l) {  /* 256 work-items load TILE * 16 elements of each */      \
        const int e = lid + 256 * l;                                                           \
        const int am = A_K_FAST ? e / TILE_K : e % TILE, ak = A_K_FAST ? e % TILE_K : e / TILE;\
        const int bn = B_K_FAST ? e / TILE_K : e % TILE, bk = B_K_FAST ? e % TILE_K : e / TILE;\
        const int k = k_begin;                                                                 \
        a_next[l] = (row0 + am < M && k + ak < k_end)                                          \
            ? LOAD_##A_T(A, A_AT(row0 + am, k + ak)) : 0.0f;                                   \
        b_next[l] = (col0 + bn < N && k + bk < k_end)                                          \
            ? LOAD_##B_T(B, B_AT(k + bk, col0 + bn)) : 0.0f;                                   \
    }                                                                                          \
    for (int k0 = k_begin; k0 < k_end; k0 += TILE_K) {                                         \
        for (int l = 0; l < WPT; ++l) {                                                        \
            const int e = lid + 256 * l;                                                       \
            const int am = A_K_FAST ? e / TILE_K : e % TILE, ak = A_K_FAST ? e % TILE_K : e / TILE;\
            const int bn = B_K_FAST ? e / TILE_K : e % TILE, bk = B_K_FAST ? e % TILE_K : e / TILE;\
            As[ak][am] = a_next[l];                                                            \
            Bs[bk][bn] = b_next[l];                                                            \
        }                                                                                      \
        barrier(CLK_LOCAL_MEM_FENCE);                                                          \
        const int k1 = k0 + TILE_K;                                                            \
        for (int l = 0; l < WPT; ++l) {                                                        \
            const int e = lid + 256 * l;                                                       \
            const int am = A_K_FAST ? e / TILE_K : e % TILE, ak = A_K_FAST ? e % TILE_K : e / TILE;\
            const int bn = B_K_FAST ? e / TILE_K : e % TILE, bk = B_K_FAST ? e % TILE_K : e / TILE;\
            a_next[l] = (row0 + am < M && k1 + ak < k_end)                                     \
                ? LOAD_##A_T(A, A_AT(row0 + am, k1 + ak)) : 0.0f;                              \
            b_next[l] = (col0 + bn < N && k1 + bk < k_end)                                     \
                ? LOAD_##B_T(B, B_AT(k1 + bk, col0 + bn)) : 0.0f;                              \
        }                                                                                      \
        for (int k = 0; k < TILE_K; ++k) {                                                     \
            float a[WPT], b[WPT];                                                              \
            for (int h = 0; h < WPT / 4; ++h) {                                                \
                const float4 a4 = vload4(0, &As[k][h * 64 + ty * 4]);                          \
                const float4 b4 = vload4(0, &Bs[k][h * 64 + tx * 4]);                          \
                a[4 * h] = a4.x; a[4 * h + 1] = a4.y; a[4 * h + 2] = a4.z; a[4 * h + 3] = a4.w;\
                b[4 * h] = b4.x; b[4 * h + 1] = b4.y; b[4 * h + 2] = b4.z; b[4 * h + 3] = b4.w;\
            }                                                                                  \
            for (int i = 0; i < WPT; ++i) for (int j = 0; j < WPT; ++j) acc[i][j] += a[i] * b[j];\
        }                                                                                      \
        barrier(CLK_LOCAL_MEM_FENCE);                                                          \
    }                                                                                          \
    for (int i = 0; i < WPT; ++i) {                                                            \
        const int r = row0 + (i / 4) * 64 + ty * 4 + i % 4;                                    \
        if (r >= M) continue;                                                                  \
        for (int j = 0; j < WPT; ++j) {                                                        \
            const int c = col0 + (j / 4) * 64 + tx * 4 + j % 4;                                \
            if (c < N) STORE_##C_T(C, r * N + c, acc[i][j] + BIAS_AT(has_bias, bias, r, c));    \
        }                                                                                      \
    }                                                                                          \
}

// Where op(A)[m][k] and op(B)[k][n] are in memory:
#define A_ROWMAJOR(m, k) ((m) * K + (k))   // A stored (M, K)
#define A_COLMAJOR(m, k) ((k) * M + (m))   // A stored (K, M): op(A) = A^T
#define B_ROWMAJOR(k, n) ((k) * N + (n))   // B stored (K, N)
#define B_COLMAJOR(k, n) ((n) * K + (k))   // B stored (N, K): op(B) = B^T
GEMM(gemm_nn, 4, 0, act_t, A_ROWMAJOR, 1, float, B_ROWMAJOR, 0, act_t)
GEMM(gemm_nt, 4, 0, act_t, A_ROWMAJOR, 1, float, B_COLMAJOR, 1, act_t)
GEMM(gemm_tn, 4, 0, float, A_COLMAJOR, 0, act_t, B_ROWMAJOR, 0, float)
GEMM(gemm_nn_big, 8, 0, act_t, A_ROWMAJOR, 1, float, B_ROWMAJOR, 0, act_t)
GEMM(gemm_nt_big, 8, 0, act_t, A_ROWMAJOR, 1, float, B_COLMAJOR, 1, act_t)
GEMM(gemm_tn_big, 8, 0, float, A_COLMAJOR, 0, act_t, B_ROWMAJOR, 0, float)
GEMM(gemm_nn_split, 4, 1, act_t, A_ROWMAJOR, 1, float, B_ROWMAJOR, 0, act_t)
GEMM(gemm_nt_split, 4, 1, act_t, A_ROWMAJOR, 1, float, B_COLMAJOR, 1, act_t)
GEMM(gemm_tn_split, 4, 1, float, A_COLMAJOR, 0, act_t, B_ROWMAJOR, 0, float)

// The vector GEMM family: the same product for operands whose contiguous dimension is a
// multiple of 4 (each row then starts 16-byte aligned: pool buffers and sub-buffers start on
// the device's base-address alignment), so every load is a float4 (a 16-byte load, half4 in
// the half build), and so is every store where C's rows are multiples of 4 too. Faster than the kernels above on GPUs (the H200 at
// n=4096: 42-44 against 25-27 TFLOP/s); the host picks a block size per product
// (netcl.py: _tiled_gemm). A work-group of THREADS = (BM / TM) (BN / TN) work-items
// computes a BM x BN block of C, each work-item a TM x TN tile of it:
// - Warp tiles: the 32 work-items of a warp (consecutive local ids) form an LM x (32 / LM)
//   grid over a (TM * LM) x (TN * 32 / LM) tile, each owning TM / 4 x TN / 4 blocks of 4x4
//   spaced LM * 4 rows and (32 / LM) * 4 columns apart, so the warp reads its operands from
//   local memory as neighbouring float4s (no bank conflicts, few distinct addresses).
// - Local memory holds two BK-deep slices of op(A) (k-major: [k][m]) and op(B) ([k][n]):
//   while the work-group multiplies one, each work-item loads its share of the next from
//   global memory into registers and stores it into the other after the multiply, so one
//   barrier per slice suffices. Rows are padded by 4 floats so the transposing stores of a
//   k-fast operand spread over the banks. The arrays are float4 so they start 16-byte
//   aligned.
// - The grid's third dimension is a batch and split-K at once, as in the tensor-core kernels
//   below (k_chunk = K: no split); the first chunk of K adds the bias.
#if HALF_STORAGE
#define LOAD4_act_t(p, i) vload_half4(0, (p) + (i))
#define STORE4_act_t(p, i, v) vstore_half4((v), 0, (p) + (i))
#else
#define LOAD4_act_t(p, i) (*(__global const float4*)((p) + (i)))
#define STORE4_act_t(p, i, v) (*(__global float4*)((p) + (i)) = (v))
#endif
#define LOAD4_float(p, i) (*(__global const float4*)((p) + (i)))
#define STORE4_float(p, i, v) (*(__global float4*)((p) + (i)) = (v))

// Work-item `tid`'s share of a ROWS x BK slice of op(X) from (r0, k0), `rows` long, into the
// float4 registers R: along k (K_FAST: X stored (rows, K)) or along the rows (X stored
// (K, rows)). Past the edges (and from k_end on), zeros: with the contiguous dimension and
// k_chunk multiples of 4, a float4 is wholly inside or wholly outside.
#define VGEMM_FETCH(R, X, X_T, K_FAST, ROWS, rows, r0, k0, BK, THREADS)                         \
    _Pragma("unroll") for (int l = 0; l < (ROWS * BK / 4 + THREADS - 1) / THREADS; ++l) {       \
        const int e = tid + THREADS * l;                                                        \
        if ((ROWS * BK / 4) % THREADS && e >= ROWS * BK / 4) break;                             \
        if (K_FAST) {                                                                           \
            const int r = (r0) + e / (BK / 4), k = (k0) + e % (BK / 4) * 4;                     \
            R[l] = r < (rows) && k < k_end ? LOAD4_##X_T(X, r * K + k) : (float4)(0.0f);        \
        } else {                                                                                \
            const int k = (k0) + e / (ROWS / 4), r = (r0) + e % (ROWS / 4) * 4;                 \
            R[l] = k < k_end && r < (rows) ? LOAD4_##X_T(X, k * (rows) + r) : (float4)(0.0f);   \
        }                                                                                       \
    }
// ... and from the registers into the local slice S ([BK][ROWS / 4 + 1] float4s): a
// k-fast operand is transposed on the way, one float at a time.
#define VGEMM_STASH(S, R, K_FAST, ROWS, BK, THREADS)                                            \
    _Pragma("unroll") for (int l = 0; l < (ROWS * BK / 4 + THREADS - 1) / THREADS; ++l) {       \
        const int e = tid + THREADS * l;                                                        \
        if ((ROWS * BK / 4) % THREADS && e >= ROWS * BK / 4) break;                             \
        if (K_FAST) {                                                                           \
            __local float* flat = (__local float*)(S);                                          \
            const int r = e / (BK / 4), k = e % (BK / 4) * 4, w = ROWS + 4;                     \
            flat[k * w + r] = R[l].x; flat[(k + 1) * w + r] = R[l].y;                           \
            flat[(k + 2) * w + r] = R[l].z; flat[(k + 3) * w + r] = R[l].w;                     \
        } else {                                                                                \
            (S)[e / (ROWS / 4)][e % (ROWS / 4)] = R[l];                                         \
        }                                                                                       \
    }
// VGEMM_KERNEL fetches op(A) and op(B) with FETCH_A and FETCH_B (VGEMM_FETCH's arguments)
// and takes EXTRA_ARGS after C: the implicit convolution's (conv2d, below) gather B from
// an image. C_RUN: 0, C stored (M, N); else C's columns are runs of C_RUN (a multiple of 4)
// stored one after another, (N / C_RUN, M, C_RUN): a convolution's output, NCHW, whose
// size may pass 2^31 elements (the index is a size_t).
#define VGEMM(NAME, BM, BN, BK, TM, TN, LM, A_T, A_K_FAST, B_T, B_K_FAST, C_T)                  \
    VGEMM_KERNEL(NAME, BM, BN, BK, TM, TN, LM, A_T, A_K_FAST, B_T, B_K_FAST, C_T, VGEMM_FETCH,  \
                 VGEMM_FETCH, , 0)
#define VGEMM_C_AT(r, c, C_RUN)                                                                 \
    ((C_RUN) ? (size_t)((c) / (C_RUN) * M + (r)) * (C_RUN) + (c) % (C_RUN)                      \
             : (size_t)((r) * N + (c)))
#define VGEMM_KERNEL(NAME, BM, BN, BK, TM, TN, LM, A_T, A_K_FAST, B_T, B_K_FAST, C_T, FETCH_A,  \
                     FETCH_B, EXTRA_ARGS, C_RUN)                                                \
__kernel __attribute__((reqd_work_group_size((BM / TM) * (BN / TN), 1, 1)))                     \
void NAME(const int M, const int N, const int K, const int k_chunk, const int batch_a,          \
          const int batch_b, const int has_bias, __global const A_T* A, __global const B_T* B,  \
          __global const float* bias, __global C_T* C EXTRA_ARGS) {                             \
    const int THREADS = (BM / TM) * (BN / TN), LN = 32 / LM;                                    \
    /* z = product * splits + split: product z / splits of a batch (A and B batch_a and */      \
    /* batch_b elements on), k in [k_begin, k_end), into its own slice of C (split-K) */        \
    const int splits = K > k_chunk ? (K + k_chunk - 1) / k_chunk : 1;  /* K = 0: one */         \
    const int product = get_group_id(2) / splits;                                               \
    const int k_begin = (get_group_id(2) - product * splits) * k_chunk;                         \
    const int k_end = min(K, k_begin + k_chunk);                                                \
    A += product * batch_a;                                                                     \
    B += product * batch_b;                                                                     \
    C += get_group_id(2) * M * N;                                                               \
    const int add_bias = has_bias && k_begin == 0;  /* split-K: the first chunk adds it */      \
    __local float4 As[2][BK][BM / 4 + 1];                                                       \
    __local float4 Bs[2][BK][BN / 4 + 1];                                                       \
    const int tid = get_local_id(0), lane = tid % 32, warp = tid / 32;                          \
    const int warps_n = BN / (TN * LN);                                                         \
    /* this work-item's first row and column in the block; the others are LM * 4 rows */        \
    /* and LN * 4 columns on */                                                                 \
    const int row = (warp / warps_n) * TM * LM + (lane / LN) * 4;                               \
    const int col = (warp % warps_n) * TN * LN + (lane % LN) * 4;                               \
    const int m0 = get_group_id(1) * BM, n0 = get_group_id(0) * BN;                             \
    float acc[TM][TN];                                                                          \
    _Pragma("unroll") for (int i = 0; i < TM; ++i)                                              \
        _Pragma("unroll") for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;                        \
    float4 a_next[(BM * BK / 4 + (BM / TM) * (BN / TN) - 1) / ((BM / TM) * (BN / TN))];         \
    float4 b_next[(BN * BK / 4 + (BM / TM) * (BN / TN) - 1) / ((BM / TM) * (BN / TN))];         \
    FETCH_A(a_next, A, A_T, A_K_FAST, BM, M, m0, k_begin, BK, THREADS)                          \
    FETCH_B(b_next, B, B_T, B_K_FAST, BN, N, n0, k_begin, BK, THREADS)                          \
    VGEMM_STASH(As[0], a_next, A_K_FAST, BM, BK, THREADS)                                       \
    VGEMM_STASH(Bs[0], b_next, B_K_FAST, BN, BK, THREADS)                                       \
    barrier(CLK_LOCAL_MEM_FENCE);                                                               \
    const int slices = (k_end - k_begin + BK - 1) / BK;                                         \
    for (int t = 0; t < slices; ++t) {                                                          \
        const int now = t & 1, more = t + 1 < slices;                                           \
        if (more) {                                                                             \
            const int k0 = k_begin + (t + 1) * BK;                                              \
            FETCH_A(a_next, A, A_T, A_K_FAST, BM, M, m0, k0, BK, THREADS)                       \
            FETCH_B(b_next, B, B_T, B_K_FAST, BN, N, n0, k0, BK, THREADS)                       \
        }                                                                                       \
        _Pragma("unroll") for (int k = 0; k < BK; ++k) {                                        \
            float a[TM], b[TN];                                                                 \
            _Pragma("unroll") for (int h = 0; h < TM / 4; ++h) {                                \
                const float4 v = As[now][k][(row + h * LM * 4) / 4];                            \
                a[4 * h] = v.x; a[4 * h + 1] = v.y; a[4 * h + 2] = v.z; a[4 * h + 3] = v.w;     \
            }                                                                                   \
            _Pragma("unroll") for (int h = 0; h < TN / 4; ++h) {                                \
                const float4 v = Bs[now][k][(col + h * LN * 4) / 4];                            \
                b[4 * h] = v.x; b[4 * h + 1] = v.y; b[4 * h + 2] = v.z; b[4 * h + 3] = v.w;     \
            }                                                                                   \
            _Pragma("unroll") for (int i = 0; i < TM; ++i)                                      \
                _Pragma("unroll") for (int j = 0; j < TN; ++j)                                  \
                    acc[i][j] = fma(a[i], b[j], acc[i][j]);                                     \
        }                                                                                       \
        if (more) {                                                                             \
            VGEMM_STASH(As[now ^ 1], a_next, A_K_FAST, BM, BK, THREADS)                         \
            VGEMM_STASH(Bs[now ^ 1], b_next, B_K_FAST, BN, BK, THREADS)                         \
        }                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                           \
    }                                                                                           \
    _Pragma("unroll") for (int i = 0; i < TM; ++i) {                                            \
        const int r = m0 + row + (i / 4) * LM * 4 + i % 4;                                      \
        if (r >= M) continue;                                                                   \
        _Pragma("unroll") for (int h = 0; h < TN / 4; ++h) {                                    \
            const int c = n0 + col + h * LN * 4;                                                \
            if (c >= N) continue;                                                               \
            const float v[4] = {acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2],            \
                                acc[i][4 * h + 3]};                                             \
            if (N % 4 == 0) {  /* whole float4s; else C's rows are not 16-byte aligned */       \
                float4 v4 = (float4)(v[0], v[1], v[2], v[3]);                                   \
                if (add_bias) v4 += has_bias == 2 ? (float4)(bias[r]) : LOAD4_float(bias, c);   \
                STORE4_##C_T(C, VGEMM_C_AT(r, c, C_RUN), v4);                                   \
            } else {                                                                            \
                _Pragma("unroll") for (int q = 0; q < 4; ++q)                                   \
                    if (c + q < N)                                                              \
                        STORE_##C_T(C, VGEMM_C_AT(r, c + q, C_RUN),                             \
                                    v[q] + BIAS_AT(add_bias ? has_bias : 0, bias, r, c + q));   \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}
// Three block sizes (rows x columns, the work-item tile, work-items), from a sweep on the
// H200: 64x64 (4x4, 256) for products with few blocks, 64x128 (8x8, 128) for mid-sized
// ones (n = 1024: 28 TFLOP/s), 128x256 (8x8, 512) for large ones (n = 4096: 42-44).
// Operand storage as in the GEMM family above.
#define VGEMM_FAMILY(SIZE, BM, BN, BK, TM, TN, LM)                                              \
VGEMM(gemm_nn_##SIZE, BM, BN, BK, TM, TN, LM, act_t, 1, float, 0, act_t)                        \
VGEMM(gemm_nt_##SIZE, BM, BN, BK, TM, TN, LM, act_t, 1, float, 1, act_t)                        \
VGEMM(gemm_tn_##SIZE, BM, BN, BK, TM, TN, LM, float, 0, act_t, 0, float)
VGEMM_FAMILY(64x64, 64, 64, 16, 4, 4, 4)
VGEMM_FAMILY(64x128, 64, 128, 16, 8, 8, 4)
VGEMM_FAMILY(128x256, 128, 256, 8, 8, 8, 4)

// GEMM on NVIDIA tensor cores, through inline PTX (built only where TENSOR_CORES is 1: the
// half build on a device whose probe below succeeded, netcl.py: Device._half_program). The
// same product as the GEMM family above, with both operands in float16 storage, accumulation
// in float32 by `mma.sync.aligned.m16n8k16` (16x8 outputs from a 16x16 by 16x8 product per
// warp), and C written as half (act_t) or float. Each work-group computes a BM x BN block of C
// with (BM / WM) x (BN / WN) warps, each a WM x WN tile:
// - Global -> local: `cp.async` copies 16 bytes (8 halves) per instruction without passing
//   through registers, STAGES k-tiles of depth TC_BK ahead (a pipeline with one barrier
//   per k-tile). A copy past the matrix's edge reads 0 bytes and zero-fills, so ragged M, N
//   and K need no separate path. Where the contiguous dimension of an operand is a multiple
//   of 8, a 16-byte copy never straddles the edge; other operands take the _u kernels,
//   which gather each chunk element by element (tc_chunk).
// - Local -> registers: `ldmatrix` loads the mma's operand fragments for a whole warp, and its
//   `.trans` form transposes 8x8 blocks on the way, so each operand stays in local memory in
//   its global layout: k-fast rows for A (M, K) and B stored (N, K), m- or n-fast rows for A
//   stored (K, M) and B stored (K, N). The 16-byte chunks of each row are XOR-swizzled so the
//   eight rows one ldmatrix reads fall in eight different bank groups.
// - Local memory is declared as uint4: the driver may start a __local uint array 4 bytes off
//   a 16-byte boundary, and a 16-byte copy or ldmatrix there faults.
#if TENSOR_CORES
#ifndef TC_BK  // 64 ran no faster (two stages of it fit in 48 KiB; netcl.py: _TC_TILE_K)
#define TC_BK 32  // k-tile depth, in halves: one 64-byte row of a k-fast tile
#endif
#define TC_ROW_CHUNKS (TC_BK / 8)  // 16-byte chunks in a k-fast tile row

// The local-memory address of a chunk, counted in 16-byte chunks from the tile's start. A
// k-fast tile row is TC_BK = 32 halves = 4 chunks; a m- or n-fast row is `per_row` chunks.
#define KFAST_CHUNK(row, c) \
    ((row) * TC_ROW_CHUNKS + ((c) ^ (((row) / (8 / TC_ROW_CHUNKS)) & (TC_ROW_CHUNKS - 1))))
#define MNFAST_CHUNK(krow, c, per_row) ((krow) * (per_row) + ((c) ^ ((krow) & 7)))

// A __local pointer cast to an integer is the shared-memory address PTX wants.
#define SHARED_ADDRESS(p) ((uint)(size_t)(p))

// `.ca` caches the copy in L1 as well (`.cg` would bypass it): the work-groups sharing a
// compute unit often read the same rows of A, which made n = 4096 5% faster on the H200.
inline void tc_copy16(__local uint4* dst, __global const ushort* src, const int valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;"
                 :: "r"(SHARED_ADDRESS(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

inline void tc_copy16_inside(__local uint4* dst, __global const ushort* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;"
                 :: "r"(SHARED_ADDRESS(dst)), "l"(src) : "memory");
}

inline void tc_ldmatrix(uint* r, const uint address, const int transposed) {
    if (transposed)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

inline void tc_mma(float* c, const uint* a, const uint* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Eight consecutive halves, the ones from `left` on zero: a chunk of an unaligned operand,
// which cp.async cannot copy, read element by element instead.
inline uint4 tc_gather8(__global const ushort* p, const int left) {
    uint h[8];
    for (int i = 0; i < 8; ++i) h[i] = i < left ? p[i] : 0;
    return (uint4)(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

// One 16-byte chunk of a tile: 8 halves from row `row` of an operand stored with rows of
// `width` elements, at column `col`, rows past `rows` and columns past `width` zero.
// aligned: width is a multiple of 8, so the chunk is a cp.async copy (or a zero fill);
// otherwise the row starts are not 16-byte aligned and the chunk is gathered.
inline void tc_chunk(__local uint4* dst, __global const ushort* X, const int row,
                     const int rows, const int col, const int width, const int aligned) {
    const int ok = row < rows && col < width;
    if (aligned)
        tc_copy16(dst, X + (ok ? row * width + col : 0), ok);
    else
        *dst = ok ? tc_gather8(X + row * width + col, width - col) : (uint4)(0);
}

// The 16-byte chunks of a ROWS-row operand tile each of THREADS work-items copies: every
// block's tiles are a whole number of them, so the copy loops have a constant trip count
// and unroll without branches (a loop from tid in steps of THREADS took 35 instructions a
// chunk on the H200: 240 against 253 TFLOP/s at n=4096 with 64x32 warp tiles).
#define TC_PER_THREAD(ROWS, THREADS) ((ROWS) * TC_BK / 8 / (THREADS))

// One operand's share of a k-tile into local memory: ROWS rows (of A: m, of B: n) from r0,
// k from k0. Stored (rows, K), it is a k-fast tile; stored (K, rows) (mn_fast), a tile of
// TC_BK rows along k. k_end: where this work-group's share of K ends (split-K), else K.
inline void tc_load_operand(__local uint4* tile, __global const ushort* X, const int rows,
                            const int K, const int k_end, const int r0, const int k0,
                            const int tid, const int threads, const int ROWS,
                            const int mn_fast, const int aligned) {
    // A tile wholly inside X is copied without the checks (n=4096: 275 against 267 TFLOP/s
    // for A B^T on the H200, n=1024: 82 against 78).
    if (aligned && r0 + ROWS <= rows && k0 + TC_BK <= k_end) {
        for (int n = 0; n < TC_PER_THREAD(ROWS, threads); ++n) {
            const int e = tid + n * threads;
            if (mn_fast) {
                const int krow = e / (ROWS / 8), c = e % (ROWS / 8);
                tc_copy16_inside(tile + MNFAST_CHUNK(krow, c, ROWS / 8),
                                 X + (k0 + krow) * rows + r0 + c * 8);
            } else {
                const int row = e / TC_ROW_CHUNKS, c = e % TC_ROW_CHUNKS;
                tc_copy16_inside(tile + KFAST_CHUNK(row, c), X + (r0 + row) * K + k0 + c * 8);
            }
        }
        return;
    }
    for (int n = 0; n < TC_PER_THREAD(ROWS, threads); ++n) {
        const int e = tid + n * threads;
        if (mn_fast) {
            const int krow = e / (ROWS / 8), c = e % (ROWS / 8), k = k0 + krow;
            tc_chunk(tile + MNFAST_CHUNK(krow, c, ROWS / 8), X, k < k_end ? k : K, K,
                     r0 + c * 8, rows, aligned);
        } else {
            const int row = e / TC_ROW_CHUNKS, c = e % TC_ROW_CHUNKS, k = k0 + c * 8;
            tc_chunk(tile + KFAST_CHUNK(row, c), X, r0 + row, rows, k < k_end ? k : K, K,
                     aligned);
        }
    }
}

// A float32 operand (the first layer's input, which autocast reads without a cast of its
// own) cannot be copied by cp.async: the copy has to round it to half. Its chunks of a
// k-tile are read into registers instead (tc_read_operand), ROWS * TC_BK / 8 / threads
// float8s per work-item, and rounded into local memory (tc_write_operand) once the tile
// before has been computed, so the loads are in flight while its products run. The
// rounding is cast_to_act's: the same halves as casting first.

// Eight floats of row `row` from column `col` (rows past `rows`, columns past `width` 0).
// Inside the matrix, two 16-byte loads in PTX, whose place among the products (volatile,
// as theirs) the compiler keeps: issued before the tile is computed, used after.
inline float8 tc_read8(__global const float* X, const int row, const int rows, const int col,
                       const int width) {
    if (row >= rows || col >= width) return (float8)(0.0f);
    __global const float* p = X + row * width + col;
    float v[8];
    if (col + 8 <= width) {
        asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "l"(p));
        asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];"
                     : "=f"(v[4]), "=f"(v[5]), "=f"(v[6]), "=f"(v[7]) : "l"(p + 4));
    } else {
        for (int i = 0; i < 8; ++i) v[i] = col + i < width ? p[i] : 0.0f;
    }
    return (float8)(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

// Eight floats rounded to halves (to nearest even, as vstore_half) and stored as one
// 16-byte chunk of local memory, after the products before it (volatile).
inline void tc_write8(__local uint4* dst, const float8 v) {
    uint h[4];
    const float f[8] = {v.s0, v.s1, v.s2, v.s3, v.s4, v.s5, v.s6, v.s7};
    for (int i = 0; i < 4; ++i)  // the lower-addressed half in the lower 16 bits
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};"
                 :: "r"(SHARED_ADDRESS(dst)), "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
}

// tc_load_operand's chunks of a float32 operand, into registers.
inline void tc_read_operand(float8* reg, __global const float* X, const int rows, const int K,
                            const int k_end, const int r0, const int k0, const int tid,
                            const int threads, const int ROWS, const int mn_fast) {
    for (int n = 0; n < TC_PER_THREAD(ROWS, threads); ++n) {
        const int e = tid + n * threads;
        if (mn_fast) {
            const int krow = e / (ROWS / 8), c = e % (ROWS / 8), k = k0 + krow;
            reg[n] = tc_read8(X, k < k_end ? k : K, K, r0 + c * 8, rows);
        } else {
            const int row = e / TC_ROW_CHUNKS, c = e % TC_ROW_CHUNKS, k = k0 + c * 8;
            reg[n] = tc_read8(X, r0 + row, rows, k < k_end ? k : K, K);
        }
    }
}

// ... and from registers into the tile, rounded to half, where tc_load_operand puts them.
inline void tc_write_operand(__local uint4* tile, const float8* reg, const int tid,
                             const int threads, const int ROWS, const int mn_fast) {
    for (int n = 0; n < TC_PER_THREAD(ROWS, threads); ++n) {
        const int e = tid + n * threads;
        const int chunk = mn_fast ? MNFAST_CHUNK(e / (ROWS / 8), e % (ROWS / 8), ROWS / 8)
                                  : KFAST_CHUNK(e / TC_ROW_CHUNKS, e % TC_ROW_CHUNKS);
        tc_write8(tile + chunk, reg[n]);
    }
}

// Start k-tile `k0` of a BM x BN block into stage `stage` of local memory: cp.async copies
// for float16 operands, register reads for a float32 one (A if F32_A, B if F32_B), which
// TC_FINISH_TILE then writes. a_t: op(A) is A^T (A stored (K, M), m-fast); b_n: op(B) is B
// (stored (K, N), n-fast), not B^T (N, K). Macros over GEMM_TC's locals.
#define TC_START_TILE(stage, k0)                                                                 \
    do {                                                                                         \
        __local uint4* As_ = smem + (stage) * stage_chunks;                                      \
        if (f32_a) tc_read_operand(a_reg, (__global const float*)A, M, K, k_end, m0, (k0), tid,  \
                                   threads, bm, a_t);                                            \
        else tc_load_operand(As_, (__global const ushort*)A, M, K, k_end, m0, (k0), tid,         \
                             threads, bm, a_t, aligned);                                         \
        if (f32_b) tc_read_operand(b_reg, (__global const float*)B, N, K, k_end, n0, (k0), tid,  \
                                   threads, bn, b_n);                                            \
        else tc_load_operand(As_ + a_chunks, (__global const ushort*)B, N, K, k_end, n0, (k0),  \
                             tid, threads, bn, b_n, aligned);                                    \
    } while (0)
#define TC_FINISH_TILE(stage)                                                                    \
    do {                                                                                         \
        if (f32_a) tc_write_operand(smem + (stage) * stage_chunks, a_reg, tid, threads, bm, a_t); \
        if (f32_b) tc_write_operand(smem + (stage) * stage_chunks + a_chunks, b_reg, tid,        \
                                    threads, bn, b_n);                                           \
    } while (0)

// C (M, N) = op(A) @ op(B) [+ bias (N)]: A, B float16 storage (or one of them float32, with
// F32_A or F32_B); C_T half or float.
#define GEMM_TC(NAME, BM, BN, WM, WN, STAGES, WAIT_OLDEST, A_T, B_N, C_T, STORE_PAIR, ALIGNED,   \
                F32_A, F32_B)                                                                    \
__kernel __attribute__((reqd_work_group_size((BM / WM) * (BN / WN) * 32, 1, 1)))                   \
void NAME(const int M, const int N, const int K, const int k_chunk, const int batch_a,         \
          const int batch_b, const int has_bias, __global const void* A,                           \
          __global const void* B, __global const float* bias, __global C_T* C) {                   \
    /* z = product * splits + split: product z / splits of a batch (A and B batch_a and */         \
    /* batch_b elements on), k in [k_begin, k_end), into its own slice of C (split-K) */           \
    const int splits = (K + k_chunk - 1) / k_chunk, product = get_group_id(2) / splits;            \
    const int k_begin = (get_group_id(2) - product * splits) * k_chunk;                            \
    const int k_end = min(K, k_begin + k_chunk);                                                   \
    A = F32_A ? (__global const void*)((__global const float*)A + product * batch_a)               \
              : (__global const void*)((__global const ushort*)A + product * batch_a);             \
    B = F32_B ? (__global const void*)((__global const float*)B + product * batch_b)               \
              : (__global const void*)((__global const ushort*)B + product * batch_b);             \
    C += get_group_id(2) * M * N;                                                                  \
    __local uint4 smem[STAGES * (BM + BN) * TC_BK / 8];                                            \
    const int threads = (BM / WM) * (BN / WN) * 32;                                                \
    const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5;                             \
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);                                        \
    const int m0 = get_group_id(1) * BM, n0 = get_group_id(0) * BN;                                \
    const int a_chunks = BM * TC_BK / 8, stage_chunks = (BM + BN) * TC_BK / 8;                     \
    /* the parameters, for TC_START_TILE and TC_FINISH_TILE */                                     \
    const int bm = BM, bn = BN, a_t = A_T, b_n = B_N, aligned = ALIGNED;                           \
    const int f32_a = F32_A, f32_b = F32_B;                                                        \
    float8 a_reg[F32_A ? TC_PER_THREAD(BM, (BM / WM) * (BN / WN) * 32) : 1];                       \
    float8 b_reg[F32_B ? TC_PER_THREAD(BN, (BM / WM) * (BN / WN) * 32) : 1];                       \
    float acc[(WM / 16)][(WN / 8)][4];                                                             \
    for (int i = 0; i < WM / 16; ++i)                                                             \
        for (int j = 0; j < WN / 8; ++j)                                                          \
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;                                      \
    const int tiles = (k_end - k_begin + TC_BK - 1) / TC_BK;                                       \
    for (int s = 0; s < STAGES - 1; ++s) {  /* prologue: the first k-tiles in flight */            \
        if (s < tiles) {                                                                           \
            TC_START_TILE(s, k_begin + s * TC_BK);                                                 \
            TC_FINISH_TILE(s);                                                                     \
        }                                                                                          \
        asm volatile("cp.async.commit_group;" ::: "memory");                                       \
    }                                                                                              \
    for (int t = 0; t < tiles; ++t) {                                                              \
        /* wait for k-tile t (at most STAGES-2 younger groups may still be in flight) */           \
        asm volatile(WAIT_OLDEST ::: "memory");                                                    \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
        /* refill the stage computed on in the last iteration: every warp is past it now */        \
        const int next = t + STAGES - 1;                                                           \
        if (next < tiles) TC_START_TILE(next % STAGES, k_begin + next * TC_BK);                    \
        asm volatile("cp.async.commit_group;" ::: "memory");                                       \
        __local uint4* As = smem + (t % STAGES) * stage_chunks;                                    \
        __local uint4* Bs = As + a_chunks;                                                         \
        for (int k16 = 0; k16 < TC_BK; k16 += 16) {                                                \
            uint a[(WM / 16)][4], b[(WN / 8)][2];                                                  \
            const int j = lane >> 3, r = lane & 7;                                                 \
            for (int i = 0; i < (WM / 16); ++i) {                                                  \
                const int mb = wm * WM + i * 16;                                                   \
                const int chunk = A_T                                                              \
                    ? MNFAST_CHUNK(k16 + r + (j >> 1) * 8, (mb >> 3) + (j & 1), BM / 8)            \
                    : KFAST_CHUNK(mb + r + (j & 1) * 8, (k16 >> 3) + (j >> 1));                    \
                tc_ldmatrix(a[i], SHARED_ADDRESS(As + chunk), A_T);                                \
            }                                                                                      \
            for (int i = 0; i < (WN / 8); i += 2) {  /* two n8 tiles per ldmatrix.x4 */            \
                const int nb = wn * WN + i * 8;                                                    \
                const int chunk = B_N                                                              \
                    ? MNFAST_CHUNK(k16 + r + (j & 1) * 8, (nb >> 3) + (j >> 1), BN / 8)            \
                    : KFAST_CHUNK(nb + r + (j >> 1) * 8, (k16 >> 3) + (j & 1));                    \
                uint q[4];                                                                         \
                tc_ldmatrix(q, SHARED_ADDRESS(Bs + chunk), B_N);                                   \
                b[i][0] = q[0]; b[i][1] = q[1]; b[i + 1][0] = q[2]; b[i + 1][1] = q[3];            \
            }                                                                                      \
            for (int i = 0; i < (WM / 16); ++i)                                                    \
                for (int n = 0; n < (WN / 8); ++n) tc_mma(acc[i][n], a[i], b[n]);                  \
        }                                                                                          \
        /* a float32 operand's next tile: into its stage, read by the warps after a barrier */     \
        if (next < tiles) TC_FINISH_TILE(next % STAGES);                                           \
    }                                                                                              \
    asm volatile("cp.async.wait_all;" ::: "memory");                                               \
    /* acc[i][n]: rows g and g + 8, columns 2t and 2t + 1 of the 16x8 tile (PTX's layout) */       \
    const int g = lane >> 2, t2 = (lane & 3) * 2;                                                  \
    for (int i = 0; i < (WM / 16); ++i)                                                            \
        for (int n = 0; n < (WN / 8); ++n) {                                                       \
            const int col = n0 + wn * WN + n * 8 + t2;                                             \
            if (col >= N) continue;                                                                \
            for (int h = 0; h < 2; ++h) {                                                          \
                const int row = m0 + wm * WM + i * 16 + g + h * 8;                                 \
                if (row >= M) continue;                                                            \
                const float b0 = BIAS_AT(has_bias, bias, row, col);                                \
                const float b1 = col + 1 < N ? BIAS_AT(has_bias, bias, row, col + 1) : 0.0f;       \
                STORE_PAIR(C, row * N + col, col + 1 < N, acc[i][n][2 * h] + b0,                   \
                           acc[i][n][2 * h + 1] + b1);                                             \
            }                                                                                      \
        }                                                                                          \
}
// Two halves of a row as one 32-bit store where their address allows (cvt.rn rounds as
// vstore_half does: to nearest even, overflow to inf); one by one elsewhere.
#define STORE_PAIR_HALF(C, i, both, v0, v1)                                                    \
    do {                                                                                       \
        __global half* p_ = (C) + (i);                                                         \
        if ((both) && !((size_t)p_ & 3)) {                                                     \
            uint h_;                                                                           \
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h_) : "f"(v1), "f"(v0));                \
            *(__global uint*)p_ = h_;                                                          \
        } else {                                                                               \
            vstore_half((v0), 0, p_);                                                          \
            if (both) vstore_half((v1), 1, p_);                                                \
        }                                                                                      \
    } while (0)
#define STORE_PAIR_FLOAT(C, i, both, v0, v1)                                                   \
    do { (C)[i] = (v0); if (both) (C)[(i) + 1] = (v1); } while (0)
// Three tile configurations, chosen per product by the host (netcl.py: _tensor_core_gemm):
// 128x128 blocks of four 64x64 warp tiles, 3 stages, for products with many blocks and a
// K of several k-tiles (at n=4096 on the H200 286 TFLOP/s for A B, against 253 with eight
// 64x32 tiles and 236-260 in 256x128 or 128x256 blocks of eight 64x64 tiles with 3 or 4
// stages: each k-tile's copies are shared by fewer products, and two work-groups share a
// compute unit); 64x64 blocks of four 32x32 warp tiles, 4 stages, for every other aligned
// product: with few blocks they keep more compute units busy, and a short K leaves the
// large block's pipeline little to overlap (the H200, by events: the small MLP's products
// 10-17 against 12-22 us in the 128x64 blocks this replaced, conv2d's three per-sample
// products 35, 29 and 85 against 35, 31 and 109 us in the 64x128, 64x128 and 128x128
// blocks they took before); and 128x64 blocks of four 64x32 warp tiles that gather their
// chunks (_u), for operands whose contiguous dimension is not a multiple of 8 (a 10-class
// output layer's gradient, say). Each stays within the 48 KiB of local memory the device
// reports. Names: layout (op(A) = A or A^T, op(B) = B or B^T), C's storage (h: half, f:
// float), and the block (l: large, s: small, u: unaligned).
#define GEMM_TC_FAMILY(BLOCK, BM, BN, WM, WN, STAGES, WAIT, ALIGNED)                           \
GEMM_TC(gemm_tc_nn_h##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 0, 1, half, STORE_PAIR_HALF,        \
        ALIGNED, 0, 0)                                                                         \
GEMM_TC(gemm_tc_nt_h##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 0, 0, half, STORE_PAIR_HALF,        \
        ALIGNED, 0, 0)                                                                         \
GEMM_TC(gemm_tc_tn_h##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 1, 1, half, STORE_PAIR_HALF,        \
        ALIGNED, 0, 0)                                                                         \
GEMM_TC(gemm_tc_nn_f##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 0, 1, float, STORE_PAIR_FLOAT,      \
        ALIGNED, 0, 0)                                                                         \
GEMM_TC(gemm_tc_nt_f##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 0, 0, float, STORE_PAIR_FLOAT,      \
        ALIGNED, 0, 0)                                                                         \
GEMM_TC(gemm_tc_tn_f##BLOCK, BM, BN, WM, WN, STAGES, WAIT, 1, 1, float, STORE_PAIR_FLOAT,      \
        ALIGNED, 0, 0)
// A float32 input's two products (netcl.py: linear): the forward x @ W^T, A float32, C
// half (_xa), and the weight gradient g^T @ x, B float32, C float (_xb).
#define GEMM_TC_FLOAT_INPUT(BLOCK, BM, BN, WM, WN, STAGES, WAIT)                                \
GEMM_TC(gemm_tc_nt_h##BLOCK##_xa, BM, BN, WM, WN, STAGES, WAIT, 0, 0, half, STORE_PAIR_HALF,   \
        1, 1, 0)                                                                               \
GEMM_TC(gemm_tc_tn_f##BLOCK##_xb, BM, BN, WM, WN, STAGES, WAIT, 1, 1, float, STORE_PAIR_FLOAT, \
        1, 0, 1)
// cp.async.wait_group takes a literal: how many younger copy groups may stay in flight.
GEMM_TC_FAMILY(_l, 128, 128, 64, 64, 3, "cp.async.wait_group 1;", 1)
GEMM_TC_FAMILY(_s, 64, 64, 32, 32, 4, "cp.async.wait_group 2;", 1)
GEMM_TC_FAMILY(_u, 128, 64, 64, 32, 4, "cp.async.wait_group 2;", 0)
GEMM_TC_FLOAT_INPUT(_l, 128, 128, 64, 64, 3, "cp.async.wait_group 1;")
GEMM_TC_FLOAT_INPUT(_s, 64, 64, 32, 32, 4, "cp.async.wait_group 2;")

// The probe netcl runs once per device before trusting the kernels above: one warp, one
// 16x8x16 product D = A B, A (16, 16) row-major and B given as B^T (8, 16), in halves.
__kernel void tensor_core_probe(__global const uint* A, __global const uint* Bt,
                                __global float* D) {
    const int lane = get_local_id(0), g = lane >> 2, t = lane & 3;
    const uint a[4] = {A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + t + 4], A[(g + 8) * 8 + t + 4]};
    const uint b[2] = {Bt[g * 8 + t], Bt[g * 8 + t + 4]};
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_mma(d, a, b);
    D[g * 8 + 2 * t] = d[0]; D[g * 8 + 2 * t + 1] = d[1];
    D[(g + 8) * 8 + 2 * t] = d[2]; D[(g + 8) * 8 + 2 * t + 1] = d[3];
}
#endif  // TENSOR_CORES

// GEMM for CPU devices (PoCL). Local memory is slow there and wide vector loads are
// fast, so both operands are first packed (transposing if asked, padding with zeros) into
// layouts whose rows are aligned vector runs: Ap (Mp, K) with Mp a multiple of PANEL_ROWS,
// and Bp (K, Np) with Np a multiple of PANEL_COLS. Each work-item then computes a
// PANEL_ROWS x PANEL_COLS block of C, two panel_v vectors per row of accumulators, with no
// bounds checks in the loop over K: with the two vectors of B and a broadcast of A they
// fill the vector registers. The block is the device's (netcl.py: _panel_shape): 6x16 in
// float8 with AVX2's sixteen registers (4x16 blocks, eight accumulators, left the
// multiply-adds waiting on each other: 1.3x slower; 8x16 spills), 12x32 in float16 with
// AVX-512's thirty-two (6x32 was 0.8x as fast, 6x16 in float8 0.55x).
// Packing reads either operand as act_t and writes float, so the inner loop never sees half;
// C is act_t.
#if PANEL_COLS == 32
typedef float16 panel_v;
#define PANEL_LOAD(p) (*(__global const float16*)(p))
// (as two float8 stores: where PoCL's compiler targets AVX2 on an AVX-512 CPU, a float16
// passed to vstore16 changes the ABI, and its stores went astray)
#define PANEL_STORE(v, p) do { vstore8((v).lo, 0, (p)); vstore8((v).hi, 0, (p) + 8); } while (0)
#else
typedef float8 panel_v;
#define PANEL_LOAD(p) (*(__global const float8*)(p))
#define PANEL_STORE(v, p) vstore8((v), 0, (p))
#endif
#define PANEL_HALF (PANEL_COLS / 2)  // the columns of one panel_v
#if !((PANEL_ROWS == 6 && PANEL_COLS == 16) || (PANEL_ROWS == 12 && PANEL_COLS == 32))
#error "the packed GEMM's blocks are 6x16 or 12x32"
#endif
// PANEL_ROW_LIST(X) is X(0) X(1) .. X(PANEL_ROWS - 1): the block's rows, one by one.
#define PANEL_ROWS_0_5(X) X(0) X(1) X(2) X(3) X(4) X(5)
#if PANEL_ROWS == 12
#define PANEL_ROW_LIST(X) PANEL_ROWS_0_5(X) X(6) X(7) X(8) X(9) X(10) X(11)
#else
#define PANEL_ROW_LIST(X) PANEL_ROWS_0_5(X)
#endif

// A matrix's columns may come in runs (conv2d's tensors (nb, rows, OH*OW) read as the matrix
// (rows, nb*OH*OW) of its samples' pixels side by side): with runs of `run` columns, run j of
// every row follows run j - 1 of them all, element (row, col) at RUN_AT(row, col, rows, run).
// A plain matrix is one run (run = its width), for which RUN_AT is row * run + col.
#define RUN_AT(row, col, rows, run) \
    (((col) / (run)) * ((rows) - 1) * (run) + (row) * (run) + (col))

// A (act_t) stored (M, K) in runs along K, or (K, M) when transposed -> Ap in panels of
// PANEL_ROWS rows: Ap[p][k][r] = A[PANEL_ROWS p + r][k] (0 past M), so that a work-item's
// rows are one contiguous run per k. A work-item packs PACK_K k's of one panel (one k each
// was 1.6-2.4x slower at n=1024), copying a whole block without checks when it lies in one
// run. The second dimension of the launch is a batch: matrix j is `batch` on in A.
#define PACK_K 8
__kernel void pack_a(const int M, const int K, const int Mp, const int transposed,
                     const int run, const int batch, __global const act_t* A,
                     __global float* Ap) {
    const int blocks = (K + PACK_K - 1) / PACK_K;
    const int i = get_global_id(0), j = get_global_id(1);  // i: PACK_K k's of one panel
    if (i >= Mp / PANEL_ROWS * blocks) return;
    const int p = i / blocks, k0 = (i - p * blocks) * PACK_K, m0 = PANEL_ROWS * p;
    A += j * batch;
    __global float* out = Ap + j * Mp * K + m0 * K + PANEL_ROWS * k0;
    if (m0 + PANEL_ROWS <= M && k0 + PACK_K <= K && (transposed || k0 % run + PACK_K <= run)) {
        if (transposed) {
            for (int k = 0; k < PACK_K; ++k)
                for (int r = 0; r < PANEL_ROWS; ++r)
                    out[PANEL_ROWS * k + r] = LOAD(A, (k0 + k) * M + m0 + r);
        } else {
            __global const act_t* rows = A + RUN_AT(m0, k0, M, run);
            for (int r = 0; r < PANEL_ROWS; ++r)
                for (int k = 0; k < PACK_K; ++k)
                    out[PANEL_ROWS * k + r] = LOAD(rows, r * run + k);
        }
        return;
    }
    for (int k = 0; k < PACK_K && k0 + k < K; ++k)
        for (int r = 0; r < PANEL_ROWS; ++r) {
            const int m = m0 + r;
            out[PANEL_ROWS * k + r] = m < M ? (transposed ? LOAD(A, (k0 + k) * M + m)
                                              : LOAD(A, RUN_AT(m, k0 + k, M, run))) : 0.0f;
        }
}

// B (act_t) stored (K, N) in runs along N, or (N, K) when transposed -> Bp in panels of
// PANEL_COLS columns: Bp[p][k][c] = B[k][PANEL_COLS p + c] (0 past N), a work-item's
// columns one contiguous run; PACK_K k's of one panel per work-item, as pack_a.
__kernel void pack_b(const int K, const int N, const int Np, const int transposed,
                     const int run, const int batch, __global const act_t* B,
                     __global float* Bp) {
    const int blocks = (K + PACK_K - 1) / PACK_K;
    const int i = get_global_id(0), j = get_global_id(1);  // i: PACK_K k's of one panel
    if (i >= Np / PANEL_COLS * blocks) return;
    const int p = i / blocks, k0 = (i - p * blocks) * PACK_K, n0 = PANEL_COLS * p;
    B += j * batch;
    __global float* out = Bp + j * K * Np + n0 * K + PANEL_COLS * k0;
    if (n0 + PANEL_COLS <= N && k0 + PACK_K <= K &&
        (transposed || n0 % run + PANEL_COLS <= run)) {
        if (transposed) {
            for (int c = 0; c < PANEL_COLS; ++c)
                for (int k = 0; k < PACK_K; ++k)
                    out[PANEL_COLS * k + c] = LOAD(B, (n0 + c) * K + k0 + k);
        } else {
            __global const act_t* rows = B + RUN_AT(k0, n0, K, run);
            for (int k = 0; k < PACK_K; ++k)
                for (int c = 0; c < PANEL_COLS; ++c)
                    out[PANEL_COLS * k + c] = LOAD(rows, k * run + c);
        }
        return;
    }
    for (int k = 0; k < PACK_K && k0 + k < K; ++k)
        for (int c = 0; c < PANEL_COLS; ++c) {
            const int n = n0 + c;
            out[PANEL_COLS * k + c] = n < N ? (transposed ? LOAD(B, n * K + k0 + k)
                                                          : LOAD(B, RUN_AT(k0 + k, n, K, run)))
                                            : 0.0f;
        }
}

// op(A) @ op(B) -> C (M, N) [+ bias (N)]; a work-item owns the PANEL_ROWS rows from
// PANEL_ROWS i and the PANEL_COLS columns from PANEL_COLS j. The blocks (i, j) are taken in
// bands of `band` column panels, a band's blocks row by row: the band's panels of B, sized
// to stay in a core's L2 cache, are then read from memory once, and each panel of A once
// per band (at n=1024 the 12x32 blocks ran 1.3x faster than row by row over all of C, and
// 1.05x faster than column by column, where each panel of B came from L3 once per row
// panel). Ap and Bp are packed panels (above) or, for
// small products that need no packing, the operands' own rows, as the strides say: element
// (row PANEL_ROWS i + r, k) of Ap is at PANEL_ROWS i K + k a_k + r a_r (panels: a_k =
// PANEL_ROWS, a_r = 1; rows: 1, K), and the PANEL_COLS columns of k in Bp start at
// PANEL_COLS j b_panel + k b_k (panels: b_panel = K, b_k = PANEL_COLS; rows: 1, Np). With
// panels the loop over K streams both operands. Products are written a*b+c: PoCL turns
// fma()/mad() into calls. The third dimension is a batch: product z reads Ap and Bp batch_a
// and batch_b on and writes C M*N on. A split K is such a batch: product z then covers
// k_chunk k's from z k_chunk (the offsets are in batch_a and batch_b) and writes its partial
// product.
// C's columns come in runs of c_run (RUN_AT, above; a plain C has one, c_run = N): conv2d's
// output has one per sample, (nb, K, OH*OW) from columns (sample, pixel), and then its bias
// is per row (bias_rows), an output channel's.
// Row r's accumulators are c<r>_0 and c<r>_1 (its two panel_v), one variable each: as an
// array they stayed in memory.
#define PANEL_ACCUMULATORS(r) panel_v c##r##_0 = 0.0f, c##r##_1 = 0.0f;
#define PANEL_ROW_OFFSET(r) const int o##r = row + r < M ? r * a_r : 0;
#define PANEL_MULTIPLY_ADD(r)                                                                  \
    { const float av = ak[A_ROW(r)]; c##r##_0 = av * b0 + c##r##_0;                          \
      c##r##_1 = av * b1 + c##r##_1; }
#define PANEL_SPILL(r) PANEL_STORE(c##r##_0, out[r]); PANEL_STORE(c##r##_1, out[r] + PANEL_HALF);
#define PANEL_STORE_ROW(r)                                                                     \
    { const float add = per_row ? bias[row + r] : 0.0f;                                        \
      PANEL_STORE(c##r##_0 + b0 + add, c_row);                                                 \
      PANEL_STORE(c##r##_1 + b1 + add, c_row + PANEL_HALF);                                    \
      c_row += c_run; }
__kernel void gemm_packed(const int M, const int N, const int K, const int k_chunk,
                          const int band, const int a_k, const int a_r,
                          const int b_panel, const int b_k, const int batch_a, const int batch_b,
                          const int c_run, const int has_bias, const int bias_rows,
                          __global const float* Ap,
                          __global const float* Bp, __global const float* bias,
                          __global act_t* C) {
    const int id = get_global_id(0), z = get_global_id(2);
    const int row_panels = (M + PANEL_ROWS - 1) / PANEL_ROWS;
    const int col_panels = (N + PANEL_COLS - 1) / PANEL_COLS;
    if (id >= row_panels * col_panels) return;  // the launch rounds up
    const int first = id / (band * row_panels) * band;  // the band's first column panel
    const int width = min(band, col_panels - first), in_band = id - first * row_panels;
    const int i = in_band / width, row = i * PANEL_ROWS;
    const int col = (first + in_band - i * width) * PANEL_COLS;
    C += z * M * N;
    __global const float* a = Ap + z * batch_a + row * K;
    __global const float* b = Bp + z * batch_b + col * b_panel;
    const int k_end = k_chunk < K ? min(k_chunk, K - z * k_chunk) : K;  // its part of K
    PANEL_ROW_LIST(PANEL_ACCUMULATORS)
    // The loop over K, k's rows of A at ak = a + k A_K and ak[A_ROW(r)] for row r, with a_k
    // a constant in each case: with a_k and the offsets all runtime values it ran 2x slower.
#define GEMM_PACKED_LOOP(A_K)                                                                  \
    _Pragma("unroll 4")                                                                        \
    for (int k = 0; k < k_end; ++k) {                                                          \
        const panel_v b0 = PANEL_LOAD(b + k * b_k), b1 = PANEL_LOAD(b + k * b_k + PANEL_HALF); \
        __global const float* ak = a + k * (A_K);                                              \
        PANEL_ROW_LIST(PANEL_MULTIPLY_ADD)                                                     \
    }
    if (a_k == PANEL_ROWS) {  // panels (a_r = 1)
#define A_ROW(r) r
        GEMM_PACKED_LOOP(PANEL_ROWS)
#undef A_ROW
    } else {  // A's own rows (a_k = 1): one past M reads row `row` instead, never stored
        PANEL_ROW_LIST(PANEL_ROW_OFFSET)
#define A_ROW(r) o##r
        GEMM_PACKED_LOOP(1)
#undef A_ROW
    }
    int at[PANEL_COLS];  // RUN_AT(0, col + c, M, c_run), with one division per work-item
    for (int c = 0, run = col / c_run, left = (run + 1) * c_run - col; c < PANEL_COLS;
         ++c, --left) {
        if (left == 0) { ++run; left = c_run; }
        at[c] = run * (M - 1) * c_run + col + c;
    }
#if !HALF_STORAGE
    // A whole block in one run: vector stores (with scalar ones, conv2d's input-gradient
    // product, K = 64, took 1.2x as long).
    if (row + PANEL_ROWS <= M && col + PANEL_COLS <= N && at[PANEL_COLS - 1] ==
        at[0] + PANEL_COLS - 1) {
        const int per_col = has_bias && !bias_rows, per_row = has_bias && bias_rows;
        const panel_v b0 = per_col ? PANEL_LOAD(bias + col) : 0.0f;
        const panel_v b1 = per_col ? PANEL_LOAD(bias + col + PANEL_HALF) : 0.0f;
        __global float* c_row = C + at[0] + row * c_run;
        PANEL_ROW_LIST(PANEL_STORE_ROW)
        return;
    }
#endif
    float out[PANEL_ROWS][PANEL_COLS];
    PANEL_ROW_LIST(PANEL_SPILL)
    for (int r = 0; r < PANEL_ROWS && row + r < M; ++r)
        for (int c = 0; c < PANEL_COLS && col + c < N; ++c)
            STORE(C, at[c] + (row + r) * c_run, out[r][c] +
                  (has_bias ? bias[bias_rows ? row + r : col + c] : 0.0f));
}

// --- shape ops -------------------------------------------------------------------------------
// Permutes, row copies (cat, stack, split, chunk, slicing) and row gathers (integer-array
// indexing, index_select). They only move values: x and out are act_t in the forward pass,
// and the float build moves the gradients back.

// x (rows, cols) -> out (cols, rows), both act_t
__kernel void transpose2d(const int rows, const int cols, __global const act_t* x,
                          __global act_t* out) {
    const int c = get_global_id(0), r = get_global_id(1);
    if (r < rows && c < cols) STORE(out, c * rows + r, LOAD(x, r * cols + c));
}

// x -> out (n elements), out = x with its dimensions permuted, seen as (s0, ..., s5): netcl.py
// merges the dimensions that move together and pads to six with size-1 dimensions in front.
// Index k of out steps t_k elements in x; s0 is implied by n.
__kernel void permute_axes(const int n, const int s1, const int s2, const int s3, const int s4,
                           const int s5, const int t0, const int t1, const int t2, const int t3,
                           const int t4, const int t5, __global const act_t* x,
                           __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    int rest = i, src = 0;
    src += (rest % s5) * t5; rest /= s5;
    src += (rest % s4) * t4; rest /= s4;
    src += (rest % s3) * t3; rest /= s3;
    src += (rest % s2) * t2; rest /= s2;
    src += (rest % s1) * t1; rest /= s1;
    src += rest * t0;
    STORE(out, i, LOAD(x, src));
}

// x (outer, x_rows, inner) -> out (outer, out_rows, inner): row out_start + j * out_step of
// out gets row x_start + j * x_step of x, for j < n. cat writes each input at its offset,
// split and slicing take rows out, and their backward passes put the gradients back.
__kernel void copy_rows(const int outer, const int n, const int inner, const int x_rows,
                        const int out_rows, const int x_start, const int x_step,
                        const int out_start, const int out_step, __global const act_t* x,
                        __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= outer * n * inner) return;
    const int k = i % inner, j = (i / inner) % n, o = i / (n * inner);
    STORE(out, (o * out_rows + out_start + j * out_step) * inner + k,
          LOAD(x, (o * x_rows + x_start + j * x_step) * inner + k));
}

// copy_rows from a float32 x into act_t storage (rounded as vstore_half): a float32 gradient
// put into its place in a float16 one (netcl.py: _pieces), with no cast pass before it.
__kernel void copy_rows_from_float(const int outer, const int n, const int inner,
                                   const int x_rows, const int out_rows, const int x_start,
                                   const int x_step, const int out_start, const int out_step,
                                   __global const float* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= outer * n * inner) return;
    const int k = i % inner, j = (i / inner) % n, o = i / (n * inner);
    STORE(out, (o * out_rows + out_start + j * out_step) * inner + k,
          x[(o * x_rows + x_start + j * x_step) * inner + k]);
}

// x (outer, rows, inner) -> out (outer, m, inner), out[o, j, k] = x[o, index[j], k], every
// index in [0, rows) (netcl.py checks them).
__kernel void gather_rows(const int outer, const int rows, const int m, const int inner,
                          __global const int* index, __global const act_t* x,
                          __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= outer * m * inner) return;
    const int k = i % inner, j = (i / inner) % m, o = i / (m * inner);
    STORE(out, i, LOAD(x, (o * rows + index[j]) * inner + k));
}

// Its backward without atomics: g (outer, m, inner) -> out (outer, rows, inner), float. Each
// work-item owns one element of out and sums g over the positions gathered from its row r,
// order[starts[r]] .. order[starts[r + 1] - 1] (positions sorted stably by index, netcl.py),
// so a row never gathered gets 0 and the sum runs in increasing position on every device.
__kernel void gather_rows_bwd(const int outer, const int rows, const int m, const int inner,
                              __global const int* starts, __global const int* order,
                              __global const float* g, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * rows * inner) return;
    const int k = i % inner, r = (i / inner) % rows, o = i / (rows * inner);
    float acc = 0.0f;
    for (int s = starts[r]; s < starts[r + 1]; ++s) acc += g[(o * m + order[s]) * inner + k];
    out[i] = acc;
}

// --- reductions ------------------------------------------------------------------------------
// A reduction over one axis sees x as (outer, R, inner) and reduces R.
// Reductions, softmax and cross-entropy read activations (act_t) and write float.

// g (outer, inner) -> out (outer, R, inner) = scale * g repeated along R: sum/mean backward.
__kernel void expand_axis(const int outer, const int R, const int inner, const float scale,
                          __global const float* g, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * R * inner) return;
    const int in = i % inner, o = i / (R * inner);
    out[i] = scale * g[o * inner + in];
}

// x (outer, R, inner) -> values (outer, inner), indices (outer, inner): the first largest
// (largest = 1) or smallest element along R, R >= 1; NaN counts as the extreme, as PyTorch.
// max and min keep the values, argmax the indices.
__kernel void extremum_axis(const int outer, const int R, const int inner, const int largest,
                            __global const act_t* x, __global float* values,
                            __global int* indices) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    __global const act_t* row = x + (i / inner) * R * inner + i % inner;
    float best = LOAD(row, 0);
    int at = 0;
    for (int r = 1; r < R && !isnan(best); ++r) {
        const float v = LOAD(row, r * inner);
        if ((largest ? v > best : v < best) || isnan(v)) { best = v; at = r; }
    }
    values[i] = best;
    indices[i] = at;
}

// g (outer, inner) -> out (outer, R, inner): g / ties * (x == value), shared equally among the
// elements equal to the extreme, as PyTorch's amax/amin backward (a NaN extreme gives NaN).
__kernel void extremum_axis_bwd(const int outer, const int R, const int inner,
                                __global const float* g, __global const act_t* x,
                                __global const float* values, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    const int base = (i / inner) * R * inner + i % inner;
    const float value = values[i];
    int ties = 0;
    for (int r = 0; r < R; ++r) ties += LOAD(x, base + r * inner) == value;
    const float share = g[i] / (float)ties;
    for (int r = 0; r < R; ++r)
        out[base + r * inner] = share * (LOAD(x, base + r * inner) == value ? 1.0f : 0.0f);
}

// x (outer, R, inner) -> out (outer, inner) = sum over R of (x - mean)^2 / dof, or its square
// root (root = 1: std). Two passes, the mean first: one pass of sum(x^2) - N mean^2 would
// cancel catastrophically when the mean is large against the spread. dof = 0 gives inf/nan.
__kernel void var_axis(const int outer, const int R, const int inner, const float dof,
                       const int root, __global const act_t* x, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    __global const act_t* row = x + (i / inner) * R * inner + i % inner;
    float total = 0.0f;
    for (int r = 0; r < R; ++r) total += LOAD(row, r * inner);
    const float mean = total / (float)R;  // R = 0: nan, as PyTorch's var of nothing
    float squares = 0.0f;
    for (int r = 0; r < R; ++r) {
        const float d = LOAD(row, r * inner) - mean;
        squares += d * d;
    }
    out[i] = root ? sqrt(squares / dof) : squares / dof;
}

// g (outer, inner) -> out (outer, R, inner) = scale g' (x - mean), scale = 2 / (R - correction),
// g' = g for var; for std (root = 1) g / (2 y), 0 where y = std = 0, as PyTorch's std_backward.
__kernel void var_axis_bwd(const int outer, const int R, const int inner, const float scale,
                           const int root, __global const float* g, __global const float* y,
                           __global const act_t* x, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    const int base = (i / inner) * R * inner + i % inner;
    const float grad = root ? (y[i] == 0.0f ? 0.0f : g[i] / (2.0f * y[i])) : g[i];
    float total = 0.0f;
    for (int r = 0; r < R; ++r) total += LOAD(x, base + r * inner);
    const float mean = total / (float)R;
    for (int r = 0; r < R; ++r)
        out[base + r * inner] = scale * grad * (LOAD(x, base + r * inner) - mean);
}

// The two passes of every log-sum-exp, softmax and cross-entropy below, over the n values of
// a row at stride `stride`: the row's maximum (fmax skips a NaN, which then reaches the sum),
// and sum exp(x - shift), with the maximum as the shift so that no exp overflows.
float row_max(__global const act_t* row, const int n, const int stride) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) m = fmax(m, LOAD(row, j * stride));
    return m;
}

float row_exp_sum(__global const act_t* row, const int n, const int stride, const float shift) {
    float total = 0.0f;
    for (int j = 0; j < n; ++j) total += exp(LOAD(row, j * stride) - shift);
    return total;
}

// x (outer, R, inner) -> out (outer, inner) = log(sum over R of exp(x)), shifted by the maximum
// (by 0 where it is infinite, as PyTorch: all -inf gives -inf, and an inf gives inf, not nan)
__kernel void logsumexp_axis(const int outer, const int R, const int inner,
                             __global const act_t* x, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    __global const act_t* row = x + (i / inner) * R * inner + i % inner;
    const float m = row_max(row, R, inner), shift = isinf(m) ? 0.0f : m;
    out[i] = shift + log(row_exp_sum(row, R, inner, shift));
}

// g, lse (outer, inner) -> out (outer, R, inner) = g * exp(x - lse), softmax(x) times g
__kernel void logsumexp_axis_bwd(const int outer, const int R, const int inner,
                                 __global const float* g, __global const act_t* x,
                                 __global const float* lse, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * R * inner) return;
    const int column = (i / (R * inner)) * inner + i % inner;
    out[i] = g[column] * exp(LOAD(x, i) - lse[column]);
}

// --- softmax and losses ----------------------------------------------------------------------
// Softmax along an axis: x (outer, R, inner) -> y, softmax or (log_mode) log-softmax.
__kernel void softmax_axis(const int outer, const int R, const int inner, const int log_mode,
                           __global const act_t* x, __global float* y) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    const int base = (i / inner) * R * inner + i % inner;
    const float m = row_max(x + base, R, inner), total = row_exp_sum(x + base, R, inner, m);
    const float log_total = log(total);
    for (int r = 0; r < R; ++r) {
        const float shifted = LOAD(x, base + r * inner) - m;
        y[base + r * inner] = log_mode ? shifted - log_total : exp(shifted) / total;
    }
}

// softmax: dx = y (g - sum(g y)); log-softmax: dx = g - exp(y) sum(g). y is the forward output.
__kernel void softmax_axis_bwd(const int outer, const int R, const int inner, const int log_mode,
                               __global const float* g, __global const float* y,
                               __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * inner) return;
    const int base = (i / inner) * R * inner + i % inner;
    float dot = 0.0f;
    for (int r = 0; r < R; ++r) {
        const int j = base + r * inner;
        dot += log_mode ? g[j] : g[j] * y[j];
    }
    for (int r = 0; r < R; ++r) {
        const int j = base + r * inner;
        out[j] = log_mode ? g[j] - exp(y[j]) * dot : y[j] * (g[j] - dot);
    }
}

// Cross-entropy, fused with log-softmax, and the other losses. One work-item per row: a
// row is the C scores of one target, read in place at stride `inner` from x (outer, C, inner)
// (logits (N, C) are outer = N, inner = 1; (N, C, d1, ...) have inner = d1 * ...), and the
// row of work-item r = o * inner + i starts at o * C * inner + i. A row whose index target is
// ignore_index loses 0 and gets no gradient. `smoothing` is label_smoothing e: the target
// becomes t' = (1 - e) t + e / C, t one-hot for an index target (PyTorch's formula).

// logits (outer, C, inner), target (outer, inner) class indices -> loss (outer, inner)
//   = (1 - e) (lse - x[target]) + e / C * sum_c (lse - x_c), lse = logsumexp(x)
__kernel void cross_entropy_index(const int outer, const int C, const int inner,
                                  const int ignore_index, const float smoothing,
                                  __global const act_t* x, __global const int* target,
                                  __global float* loss) {
    const int r = get_global_id(0);
    if (r >= outer * inner) return;
    if (target[r] == ignore_index) { loss[r] = 0.0f; return; }
    __global const act_t* row = x + (r / inner) * C * inner + r % inner;
    const float m = row_max(row, C, inner), lse = m + log(row_exp_sum(row, C, inner, m));
    float value = lse - LOAD(row, target[r] * inner);
    if (smoothing != 0.0f) {  // a third pass only when asked: with e = 0, -inf logits stay harmless
        float spread = 0.0f;
        for (int c = 0; c < C; ++c) spread += lse - LOAD(row, c * inner);
        value = (1.0f - smoothing) * value + smoothing / C * spread;
    }
    loss[r] = value;
}

// logits (outer, C, inner), target (outer, C, inner) probabilities -> loss (outer, inner)
//   = sum_c t'_c (lse - x_c)
__kernel void cross_entropy_soft(const int outer, const int C, const int inner,
                                 const float smoothing, __global const act_t* x,
                                 __global const float* target, __global float* loss) {
    const int r = get_global_id(0);
    if (r >= outer * inner) return;
    const int base = (r / inner) * C * inner + r % inner;
    __global const act_t* row = x + base;
    __global const float* t = target + base;
    const float m = row_max(row, C, inner), lse = m + log(row_exp_sum(row, C, inner, m));
    const float keep = 1.0f - smoothing, uniform = smoothing / C;
    float acc = 0.0f;
    for (int c = 0; c < C; ++c) acc += (keep * t[c * inner] + uniform) * (lse - LOAD(row, c * inner));
    loss[r] = acc;
}

// dx (outer, C, inner) = g_r (softmax(x) sum_c t'_c - t'), g_r = scale * g[r * g_stride]:
// g_stride is 0 when the loss was reduced to a scalar, 1 for reduction="none". Index targets
// are one-hot (soft = 0: `index` is read, else `target`). dx is written to out (float), or,
// where out_half is not null, rounded once into it (float16 logits' gradient: no cast after).
__kernel void cross_entropy_bwd(const int outer, const int C, const int inner,
                                const int g_stride, const float scale, const int soft,
                                const int ignore_index, const float smoothing,
                                __global const float* g, __global const act_t* x,
                                __global const int* index, __global const float* target,
                                __global float* out, __global half* out_half) {
    const int r = get_global_id(0);
    if (r >= outer * inner) return;
    const int base = (r / inner) * C * inner + r % inner;
    if (!soft && index[r] == ignore_index) {
        for (int c = 0; c < C; ++c) {
            if (out_half) vstore_half(0.0f, base + c * inner, out_half);
            else out[base + c * inner] = 0.0f;
        }
        return;
    }
    const float m = row_max(x + base, C, inner), total = row_exp_sum(x + base, C, inner, m);
    float mass = 1.0f;
    if (soft) { mass = 0.0f; for (int c = 0; c < C; ++c) mass += target[base + c * inner]; }
    const float keep = 1.0f - smoothing, uniform = smoothing / C;
    mass = keep * mass + smoothing;  // sum_c t'_c
    const float g_r = scale * g[r * g_stride];
    for (int c = 0; c < C; ++c) {
        const int j = base + c * inner;
        const float t = soft ? target[j] : (c == index[r] ? 1.0f : 0.0f);
        const float d = g_r * (exp(LOAD(x, j) - m) / total * mass - (keep * t + uniform));
        if (out_half) vstore_half(d, j, out_half);
        else out[j] = d;
    }
}

// dtarget (outer, C, inner) = g_r (1 - e) (lse - x_c) = -g_r (1 - e) log_softmax(x): the
// gradient of a probability target that requires one.
__kernel void cross_entropy_target_bwd(const int outer, const int C, const int inner,
                                       const int g_stride, const float scale,
                                       const float smoothing, __global const float* g,
                                       __global const act_t* x, __global float* out) {
    const int r = get_global_id(0);
    if (r >= outer * inner) return;
    const int base = (r / inner) * C * inner + r % inner;
    const float m = row_max(x + base, C, inner);
    const float lse = m + log(row_exp_sum(x + base, C, inner, m));
    const float g_r = scale * g[r * g_stride] * (1.0f - smoothing);
    for (int c = 0; c < C; ++c) out[base + c * inner] = g_r * (lse - LOAD(x, base + c * inner));
}

// log_probs (outer, C, inner), target (outer, inner) -> loss (outer, inner) = -x[target]
__kernel void nll_loss_fwd(const int outer, const int C, const int inner,
                           const int ignore_index, __global const act_t* x,
                           __global const int* target, __global float* loss) {
    const int r = get_global_id(0);
    if (r >= outer * inner) return;
    const int t = target[r];
    loss[r] = t == ignore_index ? 0.0f
                                : -LOAD(x, (r / inner) * C * inner + t * inner + r % inner);
}

// dx (outer, C, inner) = -scale g[r * g_stride] at row r's target class, 0 elsewhere. One
// work-item per element of dx.
__kernel void nll_loss_bwd(const int outer, const int C, const int inner, const int g_stride,
                           const float scale, const int ignore_index, __global const float* g,
                           __global const int* target, __global float* out) {
    const int i = get_global_id(0);
    if (i >= outer * C * inner) return;
    const int q = i / inner, in = i - q * inner, o = q / C, c = q - o * C, r = o * inner + in;
    out[i] = c == target[r] && c != ignore_index ? -scale * g[r * g_stride] : 0.0f;
}

// Binary cross-entropy on logits, elementwise, in PyTorch's stable form: with L = 1 + (pw - 1) t,
// loss (n) = w ((1 - t) x - L log_sigmoid(x)). The weight w and pos_weight pw repeat along the
// leading dimensions (i % size: netcl.py expands any other broadcast first); size 0: absent, 1.
// x is act_t; t, w, pw float.
float log_sigmoid(const float x) {  // min(x, 0) - log1p(exp(-|x|)): exp never overflows
    return (x < 0.0f ? x : 0.0f) - log1p(exp(-fabs(x)));
}

__kernel void bce_logits_fwd(const int n, const int w_size, const int pw_size,
                             __global const act_t* x_, __global const float* t_,
                             __global const float* w_, __global const float* pw_,
                             __global float* loss) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const float x = LOAD(x_, i), t = t_[i];
    const float w = w_size ? w_[i % w_size] : 1.0f, pw = pw_size ? pw_[i % pw_size] : 1.0f;
    loss[i] = w * ((1.0f - t) * x - (1.0f + (pw - 1.0f) * t) * log_sigmoid(x));
}

// out (n) = scale g[i * g_stride] w times dloss/dx = L sigmoid(x) - pw t, or with wrt_target
// dloss/dt = -x - (pw - 1) log_sigmoid(x).
__kernel void bce_logits_bwd(const int n, const int g_stride, const float scale,
                             const int w_size, const int pw_size, const int wrt_target,
                             __global const float* g, __global const act_t* x_,
                             __global const float* t_, __global const float* w_,
                             __global const float* pw_, __global float* out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const float x = LOAD(x_, i), t = t_[i];
    const float w = w_size ? w_[i % w_size] : 1.0f, pw = pw_size ? pw_[i % pw_size] : 1.0f;
    const float d = wrt_target ? -x - (pw - 1.0f) * log_sigmoid(x)
                               : (1.0f + (pw - 1.0f) * t) / (1.0f + exp(-x)) - pw * t;
    out[i] = scale * g[i * g_stride] * w * d;
}

// --- convolution and pooling -----------------------------------------------------------------
// Images are NCHW. Every kernel takes the window geometry in this order: input plane (H, W),
// kernel (R, S), stride (SH, SW), padding (PH, PW) on each side, dilation (DH, DW), output
// plane (OH, OW). A dilated kernel's taps are DH rows and DW columns apart, so it spans
// (R-1)*DH+1 rows; pooling windows are not dilated (DH = DW = 1). Backward kernels gather: one
// work-item per input pixel sums the outputs whose window covers it (col2im_planes: one per
// plane), so no two work-items write one place and nothing is atomic.
#define WINDOW_ARGS const int H, const int W, const int R, const int S, const int SH,            \
                    const int SW, const int PH, const int PW, const int DH, const int DW,        \
                    const int OH, const int OW

// The outputs whose window, R rows long, spans padded row hp: oh in [lo, hi], with
// lo = ceil((hp-R+1)/SH).
#define COVERING(hp, R, SH, OH, lo, hi)                                                        \
    const int lo = (hp) < (R) ? 0 : ((hp) - (R)) / (SH) + 1;                                   \
    const int hi = (hp) / (SH) < (OH) - 1 ? (hp) / (SH) : (OH) - 1;

// x (N, C, H, W) -> cols for samples n0 .. n0+nb-1: column (n, oh, ow) holds the window of
// that output pixel, row (c, r, s) one of its taps; zero over padding. Element (tap t, sample
// n, pixel l) is at t * tap_stride + n * image_stride + l: cols (C*R*S, nb*OH*OW) with
// tap_stride nb*OH*OW and image_stride OH*OW, or (nb, C*R*S, OH*OW), one matrix per sample,
// with tap_stride OH*OW and image_stride C*R*S*OH*OW. A 2-D
// launch over (output pixel, channel): each work-item copies its R*S taps, so the index
// arithmetic (integer division is slow on CPUs) is shared by R*S values, and neighbouring
// work-items still write neighbouring addresses. x is act_t, or float in im2col_act_f (a
// float32 input under autocast, rounded as it is copied: no float16 copy of it first); cols
// is float (im2col, a scratch buffer for the float GEMMs) or act_t (im2col_act and
// im2col_act_f: float16 operands for the tensor cores, in the half build). A launch over
// C + 1 channels writes a row of ones after the taps, at t = C*R*S (conv2d's weight
// gradient: that row's column of g cols^T sums g, the bias gradient).
#define IM2COL(NAME, X_T, COL_T)                                                               \
__kernel void NAME(const int n0, const int nb, const int C, WINDOW_ARGS,                       \
                   const int tap_stride, const int image_stride, __global const X_T* x,        \
                   __global COL_T* cols) {                                                     \
    const int p = get_global_id(0), c = get_global_id(1);                                      \
    if (p >= nb * OH * OW) return;                                                             \
    const int q = p / OW, ow = p - q * OW, n = q / OH, oh = q - n * OH;                        \
    __global COL_T* column = cols + c * R * S * tap_stride + n * image_stride + oh * OW + ow;  \
    if (c == C) {  /* the row of ones */                                                       \
        STORE_##COL_T(column, 0, 1.0f);                                                        \
        return;                                                                                \
    }                                                                                          \
    __global const X_T* plane = x + ((n0 + n) * C + c) * H * W;                                \
    for (int r = 0; r < R; ++r) {                                                              \
        const int h = oh * SH - PH + r * DH;                                                   \
        for (int s = 0; s < S; ++s) {                                                          \
            const int w = ow * SW - PW + s * DW;                                               \
            const int inside = h >= 0 && h < H && w >= 0 && w < W;                             \
            STORE_##COL_T(column, (r * S + s) * tap_stride,                                    \
                          inside ? LOAD_##X_T(plane, h * W + w) : 0.0f);                       \
        }                                                                                      \
    }                                                                                          \
}
IM2COL(im2col, act_t, float)
IM2COL(im2col_act, act_t, act_t)
IM2COL(im2col_act_f, float, act_t)

// im2col for CPU devices, in two steps that each run as plain copies. First pad_images pads
// the samples with zeros, so that no copy of a tap needs a bounds check (with them a one-step
// im2col ran 1.6x slower on PoCL); then the windows are copied out of the padded samples
// straight into gemm_packed's panels (what pack_b would make of im2col's cols), so the
// columns are written once and never repacked. Two layouts, P = nb*OH*OW:
// - im2col_panels: cols as the product's B, (C*R*S, P) in panels of PANEL_COLS (Pc) pixels:
//   element (tap k, pixel p) at (p / Pc) (C*R*S) Pc + Pc k + p % Pc. A work-item copies the
//   R*S taps of channel c for one panel, R*S runs of Pc floats in one contiguous block, and
//   work-item j + 1 writes the block after j's (neighbours writing neighbouring blocks made
//   it 2x faster).
// - im2col_panels_t: cols^T as B, (P, C*R*S) in panels of Pc taps: element (pixel p, tap k)
//   at (k / Pc) P Pc + Pc p + k % Pc, for conv2d's weight gradient g cols^T. A work-item
//   copies the Pc taps of one panel for PIXEL_RUN pixels, one contiguous block.
// Past P the panels of im2col_panels hold zeros, and past C*R*S those of im2col_panels_t
// copies of some pixel: columns of B that gemm_packed computes but never stores.

// x (N, C, H, W) -> padded (nb, C, H + 2 PH, W + 2 PW) for samples n0 .. n0+nb-1, float; a
// work-item writes one padded row. x is act_t.
__kernel void pad_images(const int n0, const int nb, const int C, const int H, const int W,
                         const int PH, const int PW, __global const act_t* x,
                         __global float* padded) {
    const int i = get_global_id(0), Hp = H + 2 * PH, Wp = W + 2 * PW;
    if (i >= nb * C * Hp) return;
    const int plane = i / Hp, h = i - plane * Hp - PH;
    __global float* out = padded + i * Wp;
    if (h < 0 || h >= H) {
        for (int w = 0; w < Wp; ++w) out[w] = 0.0f;
        return;
    }
    __global const act_t* row = x + (n0 * C + plane) * H * W + h * W;
    for (int w = 0; w < PW; ++w) out[w] = 0.0f;
    for (int w = 0; w < W; ++w) out[PW + w] = LOAD(row, w);
    for (int w = PW + W; w < Wp; ++w) out[w] = 0.0f;
}

// padded (nb, C, Hp, Wp) -> cols (C*R*S, P) in panels of PANEL_COLS pixels. WINDOW_ARGS are the
// unpadded x's: the window of output pixel (oh, ow) starts at padded (oh SH, ow SW). The
// panel's pixels are copied a stretch of one output row at a time: each tap's stretch is
// then one strided run of padded (gathering each pixel's own copy was 2x slower).
__kernel void im2col_panels(const int nb, const int C, WINDOW_ARGS, __global const float* padded,
                            __global float* cols) {
    const int block = get_global_id(0), P = nb * OH * OW;
    const int panels = (P + PANEL_COLS - 1) / PANEL_COLS;
    const int Hp = H + 2 * PH, Wp = W + 2 * PW;
    if (block >= panels * C) return;  // block (i, c): channel c of panel i
    const int i = block / C, c = block - i * C;
    const int p = i * PANEL_COLS;
    const int end = P - p < PANEL_COLS ? P - p : PANEL_COLS;  // pixels p .. p+end-1
    int q = p / OW, ow = p - q * OW, n = q / OH, oh = q - n * OH;
    __global float* out = cols + block * R * S * PANEL_COLS;
    for (int j = 0; j < end;) {  // pixels p+j .. p+j+len-1 lie in output row (n, oh)
        const int len = OW - ow < end - j ? OW - ow : end - j;
        __global const float* window = padded + ((n * C + c) * Hp + oh * SH) * Wp + ow * SW;
        for (int r = 0; r < R; ++r)
            for (int s = 0; s < S; ++s) {
                __global const float* tap = window + r * DH * Wp + s * DW;
                __global float* to = out + (r * S + s) * PANEL_COLS + j;
                for (int t = 0; t < len; ++t) to[t] = tap[t * SW];
            }
        j += len;
        ow += len;
        if (ow == OW) {
            ow = 0;
            if (++oh == OH) { oh = 0; ++n; }
        }
    }
    for (int k = 0; k < R * S; ++k)  // past P
        for (int j = end; j < PANEL_COLS; ++j) out[PANEL_COLS * k + j] = 0.0f;
}

#define PIXEL_RUN 64  // 16 was 1.3x slower: each work-item works out its taps first
// padded (nb, C, Hp, Wp) -> cols^T (P, C*R*S) in panels of PANEL_COLS taps; as
// im2col_panels, 16 pixels at a time: each tap's stretch of them in one output row is read as
// a strided run into a PANEL_COLS x 16 tile, whose pixels are then written out as rows of
// PANEL_COLS taps (gathering each
// pixel's taps instead was 1.2x slower). Launched with one work-item per work-group, which
// PoCL then does not interleave with its neighbours' (1.2x faster than 16).
__kernel void im2col_panels_t(const int nb, const int C, WINDOW_ARGS, const int ones,
                              __global const float* padded, __global float* cols) {
    const int i = get_global_id(0), panel = get_global_id(1), P = nb * OH * OW;
    const int Hp = H + 2 * PH, Wp = W + 2 * PW;
    if (i * PIXEL_RUN >= P) return;
    int tap[PANEL_COLS];  // where each tap lies in the window's sample
    for (int t = 0; t < PANEL_COLS; ++t) {
        const int k = panel * PANEL_COLS + t, c = k / (R * S), rs = k - c * R * S, r = rs / S;
        tap[t] = c < C ? (c * Hp + r * DH) * Wp + (rs - r * S) * DW : 0;
    }
    const int p = i * PIXEL_RUN, pixels = P - p < PIXEL_RUN ? P - p : PIXEL_RUN;
    int q = p / OW, ow = p - q * OW, n = q / OH, oh = q - n * OH;
    __global float* out = cols + (panel * P + p) * PANEL_COLS;
    for (int first = 0; first < pixels; first += 16, out += 16 * PANEL_COLS) {
        float tile[PANEL_COLS][16];  // [tap][pixel]
        const int end = pixels - first < 16 ? pixels - first : 16;
        for (int j = 0; j < end;) {  // pixels first+j .. first+j+len-1 lie in row (n, oh)
            const int len = OW - ow < end - j ? OW - ow : end - j;
            __global const float* window = padded + (n * C * Hp + oh * SH) * Wp + ow * SW;
            for (int t = 0; t < PANEL_COLS; ++t)
                for (int u = 0; u < len; ++u) tile[t][j + u] = window[tap[t] + u * SW];
            j += len;
            ow += len;
            if (ow == OW) {
                ow = 0;
                if (++oh == OH) { oh = 0; ++n; }
            }
        }
        // ones: tap C*R*S, in the padding after the taps, is a column of ones (conv2d's weight
        // gradient: its column of g cols^T sums g, the bias gradient)
        const int one = C * R * S - panel * PANEL_COLS;
        if (ones && one >= 0 && one < PANEL_COLS)
            for (int u = 0; u < end; ++u) tile[one][u] = 1.0f;
        for (int u = 0; u < end; ++u)
            for (int t = 0; t < PANEL_COLS; ++t) out[PANEL_COLS * u + t] = tile[t][u];
    }
}

// dcols (laid out as im2col's cols) -> dx (N, C, H, W) for samples n0 .. n0+nb-1: the adjoint
// of im2col, each input pixel summing the column entries that were copies of it. A 2-D launch
// over (input pixel, channel), as im2col. A dilated window's span holds rows and columns
// between its taps, which are skipped; the undilated case has its own loop, free of those
// divisions (they cost it a fifth of its time on PoCL). col2im: dcols float (a float32
// GEMM's output), dx act_t; col2im_act: dcols act_t (the tensor cores' float16 output under
// autocast, half the bytes for the product to write and this kernel to read), dx act_t, or
// float in col2im_act_f (the gradient of a float32 input).
#define COL2IM(NAME, COL_T, DX_T)                                                               \
__kernel void NAME(const int n0, const int nb, const int C, WINDOW_ARGS, const int tap_stride,  \
                     const int image_stride, __global const COL_T* dcols, __global DX_T* dx) {  \
    const int i = get_global_id(0), c = get_global_id(1);                                       \
    if (i >= nb * H * W) return;                                                                \
    const int q = i / W, w = i - q * W, n = q / H, h = q - n * H;                               \
    const int hp = h + PH, wp = w + PW;                                                         \
    COVERING(hp, (R - 1) * DH + 1, SH, OH, oh_lo, oh_hi)                                        \
    COVERING(wp, (S - 1) * DW + 1, SW, OW, ow_lo, ow_hi)                                        \
    __global const COL_T* taps = dcols + c * R * S * tap_stride + n * image_stride;             \
    float acc = 0.0f;                                                                           \
    if (DH == 1 && DW == 1) {                                                                   \
        for (int oh = oh_lo; oh <= oh_hi; ++oh) {                                               \
            const int r = hp - oh * SH;                                                         \
            for (int ow = ow_lo; ow <= ow_hi; ++ow) {                                           \
                const int s = wp - ow * SW;                                                     \
                acc += LOAD_##COL_T(taps, (r * S + s) * tap_stride + oh * OW + ow);             \
            }                                                                                   \
        }                                                                                       \
    } else {                                                                                    \
        for (int oh = oh_lo; oh <= oh_hi; ++oh) {                                               \
            const int dr = hp - oh * SH;  /* r * DH, if this row is one of the taps' */     \
            if (dr % DH) continue;                                                              \
            for (int ow = ow_lo; ow <= ow_hi; ++ow) {                                           \
                const int ds = wp - ow * SW;                                                    \
                if (ds % DW) continue;                                                          \
                acc += LOAD_##COL_T(taps, ((dr / DH) * S + ds / DW) * tap_stride +            \
                                          oh * OW + ow);                                      \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    STORE_##DX_T(dx, (((n0 + n) * C + c) * H + h) * W + w, acc);                                \
}
COL2IM(col2im, float, act_t)
COL2IM(col2im_act, act_t, act_t)
COL2IM(col2im_act_f, act_t, float)

// dcols (nb, C*R*S, OH*OW) (gemm_packed's runs, one per sample) -> dx (N, C, H, W) for
// samples n0 .. n0+nb-1: the adjoint of im2col_panels, for CPU devices. A work-item owns one
// plane (n, c) and adds each tap's OH*OW values onto a zero-padded copy of it in `padded`
// (its own: nothing is atomic and no add needs a bounds check), output row by output row,
// then copies the inside of that copy to dx (act_t: the input's storage). (col2im's gather
// reads each of a pixel's taps from another row of dcols, and its loops' bounds differ from
// pixel to pixel.)
__kernel void col2im_planes(const int n0, const int nb, const int C, WINDOW_ARGS,
                            __global const float* restrict dcols,
                            __global float* restrict padded, __global act_t* restrict dx) {
    const int i = get_global_id(0), Hp = H + 2 * PH, Wp = W + 2 * PW, L = OH * OW;
    if (i >= nb * C) return;  // i: plane (n, c) of the chunk
    __global float* plane = padded + i * Hp * Wp;
    for (int j = 0; j < Hp * Wp; ++j) plane[j] = 0.0f;
    __global const float* taps = dcols + i * R * S * L;
    for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s, taps += L)
            for (int oh = 0; oh < OH; ++oh) {
                __global float* row = plane + (oh * SH + r * DH) * Wp + s * DW;
                for (int ow = 0; ow < OW; ++ow) row[ow * SW] += taps[oh * OW + ow];
            }
    __global act_t* out = dx + (n0 * C + i) * H * W;
    for (int h = 0; h < H; ++h)
        for (int w = 0; w < W; ++w) STORE(out, h * W + w, plane[(h + PH) * Wp + PW + w]);
}

// conv2d as an implicit GEMM (GPUs): the vector GEMM (VGEMM_KERNEL above) with op(B) the
// columns im2col would write, gathered from the input as each slice is fetched, so that no
// columns are stored. `image` is the elements of one sample, C*H*W, and L = OH*OW.
// - conv_fwd_*: out[n] (K, L) = w (K, C*R*S) @ cols[n], the bias per row: where L is a
//   multiple of 4, one product over every sample's columns side by side (c_run = L: the
//   output's columns in runs of L, one per sample), so blocks run across samples' edges;
//   else one product per sample (the grid's third dimension; batch_b = image, c_run 0).
// - conv_wgrad_*: dw (K, C*R*S) = g @ cols^T, one product over every sample's pixels (K =
//   N*L, split over the grid as any long K): g (N, K, L) read as the (K, N*L) matrix of its
//   samples' pixels side by side (RUN_FETCH), cols^T gathered.
// The input gradient stays a product and col2im here: as an implicit GEMM, a convolution of
// g by the filters turned half a turn (at stride 1) took 138 µs against their 120 for the
// benchmark's conv2d on the H200, and 129 against 77 + 45 on an H100 in 32x128 blocks (for
// its 32 rows, C): its K, the taps of 64 filters, is twice the forward's, so it gathers
// twice the values for the same arithmetic. The direct convolution below reads each value
// once per chunk of channels instead, and takes 3x3 windows at stride 1, the forward's and
// the input gradient's. The tensor cores' products keep im2col_act's columns: gathering into
// registers before the local-memory stores, as a float32 operand is, took 79 against 65 µs
// for the forward and 123 against 65 for the weight gradient.

// The float4 of the columns at tap t and pixels p .. p+3 of x's samples side by side (p / L
// is the sample; L a multiple of 4 where p may pass L): zero for a tap from `taps` on, a
// pixel from `pixels` on, or a window over padding. ones >= 0 (the weight gradient with a
// bias): tap `ones` is a row of ones and the taps after it zeros, so that the product's
// column `ones` sums g over every pixel, the bias gradient.
inline float4 conv_columns4(__global const act_t* x, const int image, const int t,
                            const int taps, const int p, const int pixels, const int ones,
                            WINDOW_ARGS) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // the pixel's place first, outside the branch: the same in every slice of the forward,
    // where the compiler may then work it out once
    const int n = p / (OH * OW), l = p - n * (OH * OW), oh0 = l / OW;
    int oh = oh0, ow = l - oh0 * OW;
    if (t == ones) {
        _Pragma("unroll") for (int q = 0; q < 4; ++q) v[q] = p + q < pixels ? 1.0f : 0.0f;
    } else if (t < (ones < 0 ? taps : ones)) {
        const int c = t / (R * S), rs = t - c * (R * S), r = rs / S;
        const int dh = r * DH - PH, dw = (rs - r * S) * DW - PW;
        __global const act_t* plane = x + n * image + c * H * W;
        _Pragma("unroll") for (int q = 0; q < 4; ++q) {
            const int h = oh * SH + dh, w = ow * SW + dw;
            if (p + q < pixels && h >= 0 && h < H && w >= 0 && w < W)
                v[q] = LOAD(plane, h * W + w);
            if (++ow == OW) { ow = 0; ++oh; }
        }
    }
    return (float4)(v[0], v[1], v[2], v[3]);
}
// VGEMM_FETCH for a B of columns: (taps, pixels), or K_FAST its transpose (pixels, taps).
#define CONV_FETCH(REG, X, X_T, K_FAST, ROWS, rows, r0, k0, BK, THREADS)                       \
    _Pragma("unroll") for (int l = 0; l < (ROWS * BK / 4 + THREADS - 1) / THREADS; ++l) {       \
        const int e = tid + THREADS * l;                                                        \
        if ((ROWS * BK / 4) % THREADS && e >= ROWS * BK / 4) break;                             \
        REG[l] = K_FAST ? conv_columns4(X, image, (r0) + e / (BK / 4), rows,                    \
                                        (k0) + e % (BK / 4) * 4, k_end, ones, H, W, R, S, SH,   \
                                        SW, PH, PW, DH, DW, OH, OW)                             \
                        : conv_columns4(X, image, (k0) + e / (ROWS / 4), k_end,                 \
                                        (r0) + e % (ROWS / 4) * 4, rows, -1, H, W, R, S, SH,    \
                                        SW, PH, PW, DH, DW, OH, OW);                            \
    }
// VGEMM_FETCH for a k-fast A (rows, K) stored as runs of L: (K / L, rows, L), g's layout.
#define RUN_FETCH(REG, X, X_T, K_FAST, ROWS, rows, r0, k0, BK, THREADS)                        \
    _Pragma("unroll") for (int l = 0; l < (ROWS * BK / 4 + THREADS - 1) / THREADS; ++l) {       \
        const int e = tid + THREADS * l;                                                        \
        if ((ROWS * BK / 4) % THREADS && e >= ROWS * BK / 4) break;                             \
        const int r = (r0) + e / (BK / 4), k = (k0) + e % (BK / 4) * 4, n = k / (OH * OW);      \
        REG[l] = r < (rows) && k < k_end                                                        \
                 ? LOAD4_##X_T(X, (n * (rows) + r) * (OH * OW) + k - n * (OH * OW))             \
                 : (float4)(0.0f);                                                              \
    }
// Both take the same arguments: `ones` (conv_columns4) and c_run (the forward's output in
// runs: VGEMM_C_AT).
#define CONV_ARGS , const int image, const int ones, const int c_run, WINDOW_ARGS
#define CONV_FAMILY(SIZE, BM, BN, BK, TM, TN, LM)                                               \
VGEMM_KERNEL(conv_fwd_##SIZE, BM, BN, BK, TM, TN, LM, float, 1, act_t, 0, act_t, VGEMM_FETCH,   \
             CONV_FETCH, CONV_ARGS, c_run)                                                      \
VGEMM_KERNEL(conv_wgrad_##SIZE, BM, BN, BK, TM, TN, LM, act_t, 1, act_t, 1, float, RUN_FETCH,   \
             CONV_FETCH, CONV_ARGS, 0)
CONV_FAMILY(64x64, 64, 64, 16, 4, 4, 4)

// conv_wgrad's partial products (splits, K, width) with a column of ones at `taps` (its
// sums over every pixel: the bias gradient), summed: columns below `taps` into dw (K, taps),
// column `taps` into db (K); the columns after it are padding.
__kernel void conv_wgrad_sum(const int splits, const int K, const int taps, const int width,
                             __global const float* parts, __global float* dw,
                             __global float* db) {
    const int i = get_global_id(0);
    if (i >= K * width) return;
    const int k = i / width, t = i - k * width;
    if (t > taps) return;
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) acc += parts[s * K * width + i];
    if (t < taps) dw[k * taps + t] = acc;
    else db[k] = acc;
}

// conv2d with 3x3 filters at stride 1, undilated, as a direct convolution (GPUs): a
// work-group computes BM output channels at BN consecutive output pixels of one sample. For
// each chunk of CK input channels it copies two things into local memory: the filters' taps
// of the chunk, and the halo, the input rows the windows of its pixels cover (every column
// of the windows' span, zero past the image's edges). Each tap then reads its inputs from
// the halo, so an input value comes from global memory once per chunk, where the implicit
// GEMM (conv_fwd above) gathers it once for each of the 9 taps that see it, with the
// divisions that place it; and the taps' loops unroll, so a tap's place in the halo is a
// constant. The input gradient of such a convolution is another one: g convolved with the
// filters turned half a turn (conv_filters), padded by 2 - PH and 2 - PW.
// wt (C*9, M) holds each tap's filters side by side (conv_filters), ws its chunk as float4s
// of four filters, halo the chunk's CK planes of halo_rows x halo_width values. Work-item
// (lane, mg) computes rows 4 mg .. 4 mg + 3 of each 4 * BM / TM and pixels
// p0 + lane + j * BN / TN, so that a warp's lanes read neighbouring halo values. In the build
// of x's and out's storage (act_t); the sums are float32.
#define CONV_DIRECT(NAME, BM, BN, TM, TN)                                                      \
__kernel __attribute__((reqd_work_group_size((BM / TM) * (BN / TN), 1, 1)))                     \
void NAME(const int M, const int C, const int CK, const int tiles, const int has_bias,          \
          const int halo_rows, const int halo_width, __global const float* wt,                  \
          __global const act_t* x, __global const float* bias, __global act_t* out,            \
          __local float4* ws, __local float* halo, WINDOW_ARGS) {                               \
    const int THREADS = (BM / TM) * (BN / TN), LANES = BN / TN;                                 \
    const int tid = get_local_id(0), lane = tid % LANES, mg = tid / LANES;                      \
    const int n = get_group_id(0) / tiles, p0 = (get_group_id(0) - n * tiles) * BN;            \
    const int m0 = get_group_id(1) * BM, L = OH * OW;                                           \
    const int plane = halo_rows * halo_width, first = p0 / OW;                                  \
    const int row0 = first - PH;  /* the input row of the halo's first row */                   \
    int at[TN];  /* each pixel's window's corner in a plane of the halo */                      \
    _Pragma("unroll") for (int j = 0; j < TN; ++j) {                                            \
        const int p = min(p0 + lane + j * LANES, L - 1), oh = p / OW;                           \
        at[j] = (oh - first) * halo_width + p - oh * OW;                                        \
    }                                                                                           \
    float acc[TM][TN];                                                                          \
    _Pragma("unroll") for (int i = 0; i < TM; ++i)                                              \
        _Pragma("unroll") for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;                        \
    x += (size_t)n * C * H * W;  /* size_t: a batch may pass 2^31 elements */                   \
    for (int c0 = 0; c0 < C; c0 += CK) {                                                        \
        const int ck = min(CK, C - c0);                                                         \
        for (int e = tid; e < ck * 9 * (BM / 4); e += THREADS) {                                \
            const int t = e / (BM / 4), m = m0 + (e - t * (BM / 4)) * 4;                        \
            __global const float* src = wt + (c0 * 9 + t) * M + m;                              \
            ws[e] = (float4)(m < M ? src[0] : 0.0f, m + 1 < M ? src[1] : 0.0f,                  \
                             m + 2 < M ? src[2] : 0.0f, m + 3 < M ? src[3] : 0.0f);             \
        }                                                                                       \
        for (int e = tid; e < plane; e += THREADS) {  /* one place, every channel's value */    \
            const int hr = e / halo_width, h = row0 + hr, w = e - hr * halo_width - PW;         \
            const int inside = h >= 0 && h < H && w >= 0 && w < W;                              \
            __global const act_t* src = x + c0 * H * W + (inside ? h * W + w : 0);              \
            for (int c = 0; c < ck; ++c)                                                        \
                halo[c * plane + e] = inside ? LOAD(src, c * H * W) : 0.0f;                     \
        }                                                                                       \
        barrier(CLK_LOCAL_MEM_FENCE);                                                           \
        for (int c = 0; c < ck; ++c)                                                            \
            _Pragma("unroll") for (int r = 0; r < 3; ++r)                                       \
                _Pragma("unroll") for (int s = 0; s < 3; ++s) {                                 \
                    __local const float* in = halo + c * plane + r * halo_width + s;            \
                    __local const float4* a4 = ws + ((c * 3 + r) * 3 + s) * (BM / 4) + mg;      \
                    float a[TM], b[TN];                                                         \
                    _Pragma("unroll") for (int h = 0; h < TM / 4; ++h) {                        \
                        const float4 v = a4[h * (BM / TM)];                                     \
                        a[4 * h] = v.x; a[4 * h + 1] = v.y; a[4 * h + 2] = v.z;                 \
                        a[4 * h + 3] = v.w;                                                     \
                    }                                                                           \
                    _Pragma("unroll") for (int j = 0; j < TN; ++j) b[j] = in[at[j]];            \
                    _Pragma("unroll") for (int i = 0; i < TM; ++i)                              \
                        _Pragma("unroll") for (int j = 0; j < TN; ++j)                          \
                            acc[i][j] = fma(a[i], b[j], acc[i][j]);                             \
                }                                                                               \
        barrier(CLK_LOCAL_MEM_FENCE);                                                           \
    }                                                                                           \
    _Pragma("unroll") for (int i = 0; i < TM; ++i) {                                            \
        const int m = m0 + 4 * (mg + (i / 4) * (BM / TM)) + i % 4;                              \
        if (m >= M) continue;                                                                   \
        const float b = has_bias ? bias[m] : 0.0f;                                              \
        _Pragma("unroll") for (int j = 0; j < TN; ++j) {                                        \
            const int p = p0 + lane + j * LANES;                                                \
            if (p < L) STORE(out, ((size_t)n * M + m) * L + p, acc[i][j] + b);                  \
        }                                                                                       \
    }                                                                                           \
}
CONV_DIRECT(conv_direct_64x128, 64, 128, 8, 8)
CONV_DIRECT(conv_direct_32x128, 32, 128, 4, 8)

// conv2d's filters w (K, C, R, S) as conv_direct reads them, in one pass into either or
// both (a null pointer skips one): forward (C*R*S, K), each tap's K filters side by side;
// turned, for the input gradient, the filters turned half a turn in (r, s) with the roles
// of K and C swapped, (K*R*S, C): turned[(k*RS + RS-1-t) * C + c] = w[k, c, t].
__kernel void conv_filters(const int K, const int C, const int RS, __global const float* w,
                           __global float* forward, __global float* turned) {
    const int i = get_global_id(0);  // the element (k, c, t) of w
    if (i >= K * C * RS) return;
    const int k = i / (C * RS), c = (i - k * C * RS) / RS, t = i - (k * C + c) * RS;
    if (forward) forward[(c * RS + t) * K + k] = w[i];
    if (turned) turned[(k * RS + RS - 1 - t) * C + c] = w[i];
}

#if WINOGRAD
// conv2d's 3x3 convolutions at stride 1, undilated, by Winograd's minimal filtering
// F(2x2, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016):
// each 2x2 block of output pixels (a tile) comes from the 4x4 input values its windows
// cover, d, as Y = A^T [sum over channels of U ⊙ V] A, with V = B^T d B per channel and
// U = G w G^T per filter and channel (winograd_filters), where
//   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1],  G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2;
//   0 0 1],  A^T = [1 1 1 0; 0 1 -1 -1]:
// 16 multiplications per tile, filter and channel where the direct convolution takes 36,
// so 16 products (one per place xi of the 4x4) of filters x channels by channels x tiles.
// The input gradient is the same convolution of g by the filters turned half a turn, with
// the roles of K and C swapped, padded by 2 - PH and 2 - PW (conv_direct's comment). The
// weight gradient is its transpose: dw = G^T [sum over tiles of (A dy A^T) ⊙ V] G, with
// dy the tile's 2x2 output gradients (conv_winograd_wgrad). The transforms add and halve
// only, so the results are within a few float32 roundings of the direct sums. Built only
// where the device has the local memory and work-group size they take (WINOGRAD): their
// static local arrays and required work-group sizes would fail the whole build elsewhere.
// They are in the float32 build only and read and write either storage, as each tensor's
// `*_mode` argument says (wino_load), so that autocast needs no float16 copy of a float32
// input, nor of a float32 gradient, and writes a float32 input's gradient directly.
#define WINO_CK 8  // the tiles a chunk of the weight gradient forms in local memory

// v rounded to the nearest float16 value (ties to even), as a float
inline float wino_round(const float v) {
    ushort h;
    vstore_half(v, 0, (__private half*)&h);
    return vload_half(0, (__private const half*)&h);
}

// Element i of a Winograd kernel's tensor p by its storage `mode`: 0 float32; 1 float32
// whose values are rounded to float16 as they are read or written (autocast's rounding of a
// float32 tensor, as a float16 copy would give); 2 float16 (p then points at halves).
inline float wino_load(__global const float* p, const size_t i, const int mode) {
    if (mode == 2) return vload_half(i, (__global const half*)p);
    return mode == 1 ? wino_round(p[i]) : p[i];
}

// A value of a Winograd kernel's tensor in two steps, for conv_winograd_*_r: its bits as
// stored (the element at i where `inside`, else 0), read without a branch (outside, element
// 0, which every tensor here has, is read and dropped), then its value (wino_decode), once
// the products the load was issued before have run. wino_load, in the driver's PTX, converts
// each value right after its load, in a branch of its own: a work-item's loads one by one.
inline uint wino_raw_if(__global const float* p, const size_t i, const int mode,
                        const int inside) {
    const size_t j = inside ? i : 0;
    const uint v = mode == 2 ? (uint)((__global const ushort*)p)[j] : as_uint(p[j]);
    return inside ? v : 0u;
}

inline float wino_decode(const uint v, const int mode) {
    if (mode == 2) {
        const ushort h = (ushort)v;
        return vload_half(0, (__private const half*)&h);
    }
    return mode == 1 ? wino_round(as_float(v)) : as_float(v);
}

inline void wino_store(__global float* p, const size_t i, const float v, const int mode) {
    if (mode == 2) vstore_half(v, i, (__global half*)p);  // rounds to nearest even
    else p[i] = mode == 1 ? wino_round(v) : v;
}

// u (4x4, row-major) = G f G^T of one 3x3 filter f (row-major)
inline void wino_filter(const float f[9], float u[16]) {
    float t[12];  // G f (4x3)
    for (int s = 0; s < 3; ++s) {
        t[s] = f[s];
        t[3 + s] = 0.5f * (f[s] + f[3 + s] + f[6 + s]);
        t[6 + s] = 0.5f * (f[s] - f[3 + s] + f[6 + s]);
        t[9 + s] = f[6 + s];
    }
    for (int r = 0; r < 4; ++r) {
        u[4 * r] = t[3 * r];
        u[4 * r + 1] = 0.5f * (t[3 * r] + t[3 * r + 1] + t[3 * r + 2]);
        u[4 * r + 2] = 0.5f * (t[3 * r] - t[3 * r + 1] + t[3 * r + 2]);
        u[4 * r + 3] = t[3 * r + 2];
    }
}

// conv2d's 3x3 filters w (K, C, 3, 3) transformed for conv_winograd_*, in one pass into
// either or both (a null pointer skips one): forward (16, C, Kp), U of filter k and channel
// c at [(xi * C + c) * Kp + k]; turned (16, K, Cp), the input gradient's: the filters turned
// half a turn, with K and C swapped. Zeros past K (past C) up to Kp (Cp), multiples of 4:
// the convolution reads them in float4s. A work-item per (c, k) of C x Kp for the forward,
// then per (k, c) of K x Cp for the turned: consecutive work-items write consecutive values.
__kernel void winograd_filters(const int K, const int C, const int Kp, const int Cp,
                               __global const float* w, __global float* forward,
                               __global float* turned) {
    const int i = get_global_id(0), turn = i >= C * Kp;
    const int j = turn ? i - C * Kp : i;
    if (turn ? !turned || j >= K * Cp : !forward) return;
    const int k = turn ? j / Cp : j % Kp, c = turn ? j % Cp : j / Kp;
    float f[9], u[16];
    for (int t = 0; t < 9; ++t)  // the turned filter's taps in reverse
        f[turn ? 8 - t : t] = k < K && c < C ? w[(k * C + c) * 9 + t] : 0.0f;
    wino_filter(f, u);
    for (int x = 0; x < 16; ++x) {
        if (turn) turned[(x * K + k) * Cp + c] = u[x];
        else forward[(x * C + c) * Kp + k] = u[x];
    }
}

// Rows 2 upper and 2 upper + 1 of V = B^T d B (upper 0 or 1), of the 4x4 input values d
// whose top-left is (row, col) of the (H, W) plane at element `plane` of x (zeros outside
// it; x's storage `mode`: wino_load), into v[8] (row-major): half the transform, which
// needs rows upper .. upper + 2 of d.
inline void wino_input_half(__global const float* x, const size_t plane, const int mode,
                            const int row, const int col, const int H, const int W,
                            const int upper, float v[8]) {
    float d[3][4];
    for (int r = 0; r < 3; ++r)
        for (int s = 0; s < 4; ++s) {
            const int h = row + upper + r, w = col + s;
            d[r][s] = h >= 0 && h < H && w >= 0 && w < W ? wino_load(x, plane + h * W + w, mode)
                                                         : 0.0f;
        }
    float e[2][4];  // the two rows of B^T d
    for (int s = 0; s < 4; ++s) {
        e[0][s] = upper ? d[1][s] - d[0][s] : d[0][s] - d[2][s];
        e[1][s] = upper ? d[0][s] - d[2][s] : d[1][s] + d[2][s];
    }
    for (int q = 0; q < 2; ++q) {
        v[4 * q] = e[q][0] - e[q][2];
        v[4 * q + 1] = e[q][1] + e[q][2];
        v[4 * q + 2] = e[q][2] - e[q][1];
        v[4 * q + 3] = e[q][1] - e[q][3];
    }
}

// acc[i][j] += the products over a chunk of STEPS steps of a 16-place product: at each
// step a row (rows_a apart) of a local operand `A_` for rows 4 ga + i % 4 + (BA / 2)(i / 4)
// and one of `B_` for columns 4 gb + j % 4 + (BB / 2)(j / 4), both read in float4s; with
// `swizzle`, the float4s of step s are stored at (float4 index) ^ s (conv_winograd_wgrad).
#define WINO_PRODUCTS(A_, B_, BA, BB, swizzle, STEPS)                                              \
    for (int s = 0; s < (STEPS); ++s) {                                                            \
        const int z = (swizzle) ? s : 0;                                                           \
        __local const float4* a4 = A_ + (xi * (STEPS) + s) * (BA / 4);                             \
        __local const float4* b4 = B_ + (xi * (STEPS) + s) * (BB / 4);                             \
        const float4 a0 = a4[ga ^ z], a1 = a4[(ga + BA / 8) ^ z];                                  \
        const float4 b0 = b4[gb ^ z], b1 = b4[(gb + BB / 8) ^ z];                                  \
        const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};                       \
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};                       \
        _Pragma("unroll") for (int i = 0; i < 8; ++i)                                              \
            _Pragma("unroll") for (int j = 0; j < 8; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);  \
        if (SUM_A) {                                                                               \
            for (int i = 0; i < 8; ++i) sum_a[i] += a[i];                                          \
        }                                                                                          \
    }

// Round r of 4 in which the 16 places of acc's rows 2r and 2r + 1 go through local memory
// o (BA / 4 rows of BB + 1 values per place, ordered (q, ga) for row 2r + q of work-item
// ga: a warp's stores meet a bank twice at most), so that one work-item holds all 16 of
// one (row, column): rounds, because all of acc at once would not fit. After the barrier,
// work-item tid reads the 16 of local row tid / BB, column tid % BB into m16; that row is
// row `ra` of the block.
#define WINO_GATHER(r, o, BA, BB, m16, ra)                                                         \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                  \
    _Pragma("unroll") for (int q = 0; q < 2; ++q)                                                  \
        _Pragma("unroll") for (int j = 0; j < 8; ++j)                                              \
            o[(xi * (BA / 4) + q * (BA / 8) + ga) * (BB + 1) + 4 * gb + j % 4 +                    \
              (BB / 2) * (j / 4)] = acc[2 * (r) + q][j];                                           \
    barrier(CLK_LOCAL_MEM_FENCE);                                                                  \
    const int rr = tid / (BB), cc = tid - rr * (BB);                                               \
    _Pragma("unroll") for (int p = 0; p < 16; ++p)                                                 \
        m16[p] = o[(p * (BA / 4) + rr) * (BB + 1) + cc];                                           \
    const int ra = 4 * (rr % (BA / 8)) + (2 * (r)) % 4 + rr / (BA / 8) + (BA / 2) * ((r) / 2);     \

// conv_winograd's end: rounds of WINO_GATHER, then Y = A^T M A (+ bias) into out.
#define WINO_OUTPUT(BM, BT)                                                                        \
    for (int r = 0; r < 4; ++r) {                                                                  \
        float m16[16];                                                                             \
        WINO_GATHER(r, o, BM, BT, m16, row)                                                        \
        const int m = m0 + row, tile = t0 + cc;                                                    \
        if (m < M && tile < T) {                                                                   \
            const int n = tile / plane, th = (tile - n * plane) / TW;                              \
            const int tw = tile - n * plane - th * TW;                                             \
            const float b = has_bias ? bias[m] : 0.0f;                                             \
            float s[2][4];  /* A^T M */                                                            \
            _Pragma("unroll") for (int k = 0; k < 4; ++k) {                                        \
                s[0][k] = m16[k] + m16[4 + k] + m16[8 + k];                                        \
                s[1][k] = m16[4 + k] - m16[8 + k] - m16[12 + k];                                   \
            }                                                                                      \
            const size_t y = ((size_t)n * M + m) * OH * OW;                                        \
            _Pragma("unroll") for (int a = 0; a < 2; ++a) {                                        \
                const int oh = 2 * th + a, ow = 2 * tw;                                            \
                if (oh >= OH) break;                                                               \
                const size_t at = y + oh * OW + ow;                                                \
                wino_store(out, at, s[a][0] + s[a][1] + s[a][2] + b, out_mode);                    \
                if (ow + 1 < OW)                                                                   \
                    wino_store(out, at + 1, s[a][1] - s[a][2] - s[a][3] + b, out_mode);            \
            }                                                                                      \
        }                                                                                          \
    }


// The forward (and the input gradient): a work-group computes BM output channels at BT
// tiles (of the T = N * TH * TW of the batch, TH x TW per sample) for all 16 places.
// Work-item (xi, gb, ga) sums 8 of them by 8 tiles at one place xi (a warp per place: the
// lanes of a float4 load read different float4s, or the same). The input channels go in
// chunks of WINO_FWD_CK through two local buffers: each chunk's U (16 x WINO_FWD_CK x BM,
// from u (16, C, Mp): winograd_filters) and V of the group's tiles (16 x WINO_FWD_CK x BT,
// a row of one per unit: 64 / BM units a work-item), loaded from global memory into
// registers before the products of the chunk before it, and stored (V transformed) into
// the other buffer after them: the loads' latency under the products, one barrier a chunk.
// Then WINO_OUTPUT: out (N, M, OH, OW) [+ bias (M,)]. x and out in the storage their modes
// give (wino_load), sums float32. RAW: x's values kept as their stored bits until the
// transform (wino_raw_if), for a float32 x rounded as it is read (x_mode 1: autocast's first
// layer, or an input gradient from a float32 seed): on an H100 the benchmark's forward and
// input gradient took 69 and 91 us rounding each value as it was loaded, 67 and 81 this
// way. Float32 and float16 x keep the kernels without RAW: a float32 one was slower this
// way (65 against 61 us, 84 against 67), a float16 one no faster (82 against 82).
#define WINO_FWD_CK 4
#define CONV_WINOGRAD(NAME, BM, BT, RAW)                                                           \
__kernel __attribute__((reqd_work_group_size(BM * BT / 4, 1, 1)))                                  \
void NAME(const int M, const int C, const int Mp, const int T, const int TH, const int TW,         \
          const int has_bias, __global const float* u, __global const float* x,                    \
          __global const float* bias, __global float* out, const int x_mode, const int out_mode,   \
          WINDOW_ARGS) {                                                                           \
    const int THREADS = BM * BT / 4, SUM_A = 0, UN = 64 / BT, VN = 64 / BM;                        \
    const int STAGE = 16 * WINO_FWD_CK * (BM + BT) / 4;  /* float4s of one buffer */               \
    __local float4 lds[2 * 16 * WINO_FWD_CK * (BM + BT) / 4];                                      \
    __local float* o = (__local float*)lds;                                                        \
    const int tid = get_local_id(0), ga = tid % (BM / 8), gb = tid / (BM / 8) % (BT / 8);          \
    const int xi = tid / (BM * BT / 64);                                                           \
    const int t0 = get_group_id(0) * BT, m0 = get_group_id(1) * BM, plane = TH * TW;               \
    float acc[8][8], sum_a[8];                                                                     \
    _Pragma("unroll") for (int i = 0; i < 8; ++i)                                                  \
        _Pragma("unroll") for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;                            \
    float4 ureg[64 / BT];                                                                          \
    uint vreg[64 / BM][8];  /* float bits unless RAW (wino_raw_if) */                              \
    for (int c0 = -WINO_FWD_CK; c0 < C; c0 += WINO_FWD_CK) {                                       \
        const int next = c0 + WINO_FWD_CK;                                                         \
        if (next < C) {  /* the next chunk's loads */                                              \
            _Pragma("unroll") for (int l = 0; l < UN; ++l) {                                       \
                const int e = tid + l * THREADS, q = e % (BM / 4), rest = e / (BM / 4);            \
                const int m = m0 + 4 * q, c = next + rest % WINO_FWD_CK;                           \
                ureg[l] = c < C && m < Mp ? vload4(0, u + ((rest / WINO_FWD_CK) * C + c) * Mp + m) \
                                          : (float4)(0.0f);                                        \
            }                                                                                      \
            _Pragma("unroll") for (int l = 0; l < VN; ++l) {                                       \
                const int e = tid + l * THREADS, t = e % BT, ck = e / BT % WINO_FWD_CK;            \
                const int row = e / (BT * WINO_FWD_CK), tile = t0 + t, c = next + ck;              \
                /* row i of B^T d takes d's rows ra and rb */                                      \
                const int ra = row == 0 ? 0 : 1, rb = row == 3 ? 3 : 2;                            \
                _Pragma("unroll") for (int s = 0; s < 8; ++s) vreg[l][s] = 0u;  /* 0.0f */        \
                if (tile < T && c < C) {                                                           \
                    const int n = tile / plane, th = (tile - n * plane) / TW;                      \
                    const int tw = tile - n * plane - th * TW;                                     \
                    const size_t p = ((size_t)n * C + c) * H * W;                                  \
                    const int h0 = 2 * th - PH, w0 = 2 * tw - PW;                                  \
                    _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                \
                        const int w = w0 + s, ha = h0 + ra, hb = h0 + rb;                          \
                        const int in_w = w >= 0 && w < W;                                          \
                        const int in_a = in_w && ha >= 0 && ha < H;                                \
                        const int in_b = in_w && hb >= 0 && hb < H;                                \
                        if (RAW) {                                                                 \
                            vreg[l][s] = wino_raw_if(x, p + ha * W + w, x_mode, in_a);             \
                            vreg[l][4 + s] = wino_raw_if(x, p + hb * W + w, x_mode, in_b);         \
                        } else {                                                                   \
                            if (in_a) vreg[l][s] = as_uint(wino_load(x, p + ha * W + w, x_mode));  \
                            if (in_b)                                                              \
                                vreg[l][4 + s] = as_uint(wino_load(x, p + hb * W + w, x_mode));    \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        if (c0 >= 0) {  /* this chunk's products */                                                \
            __local const float4* us = lds + ((c0 / WINO_FWD_CK) & 1) * STAGE;                     \
            __local const float4* vs = us + 16 * WINO_FWD_CK * BM / 4;                             \
            WINO_PRODUCTS(us, vs, BM, BT, 0, WINO_FWD_CK)                                          \
        }                                                                                          \
        if (next < C) {  /* the next chunk into the other buffer */                                \
            __local float4* us = lds + ((next / WINO_FWD_CK) & 1) * STAGE;                         \
            __local float* vf = (__local float*)(us + 16 * WINO_FWD_CK * BM / 4);                  \
            _Pragma("unroll") for (int l = 0; l < UN; ++l) us[tid + l * THREADS] = ureg[l];        \
            _Pragma("unroll") for (int l = 0; l < VN; ++l) {                                       \
                const int e = tid + l * THREADS, t = e % BT, ck = e / BT % WINO_FWD_CK;            \
                const int row = e / (BT * WINO_FWD_CK);                                            \
                float r[4];  /* row `row` of B^T d, then times B */                                \
                _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                    \
                    const float a = RAW ? wino_decode(vreg[l][s], x_mode) : as_float(vreg[l][s]);  \
                    const float b = RAW ? wino_decode(vreg[l][4 + s], x_mode)                      \
                                        : as_float(vreg[l][4 + s]);                                \
                    r[s] = row == 0 ? a - b : row == 1 ? a + b : row == 2 ? b - a : a - b;         \
                }                                                                                  \
                const float v[4] = {r[0] - r[2], r[1] + r[2], r[2] - r[1], r[1] - r[3]};           \
                _Pragma("unroll") for (int s = 0; s < 4; ++s)                                      \
                    vf[((4 * row + s) * WINO_FWD_CK + ck) * BT + t] = v[s];                        \
            }                                                                                      \
        }                                                                                          \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
    }                                                                                              \
    WINO_OUTPUT(BM, BT)                                                                            \
}
CONV_WINOGRAD(conv_winograd_64x32, 64, 32, 0)
CONV_WINOGRAD(conv_winograd_32x32, 32, 32, 0)
CONV_WINOGRAD(conv_winograd_64x32_r, 64, 32, 1)
CONV_WINOGRAD(conv_winograd_32x32_r, 32, 32, 1)

// The weight gradient: a work-group sums, over the tiles of its split (`chunk` of the T,
// from split * chunk on), Y ⊙ V at every place for BK filters by BC channels, Y = A dy A^T
// of the tile's 2x2 output gradients dy per filter, V of its 4x4 inputs per channel, both
// formed WINO_CK tiles at a time in local memory (their float4s swizzled by tile, so that
// the lanes storing one tile's values meet no bank twice); then dw = G^T S G per (filter,
// channel) of those sums S, into parts (splits, K, width) at [k, c * 9 + r * 3 + s], and
// where width > C * 9, the sums of dy (the bias gradient: Y's place 5 is the sum of dy)
// into column C * 9. g (N, K, OH, OW) and x in the storage their modes give (wino_load).
#define CONV_WINOGRAD_WGRAD(NAME, BK, BC)                                                          \
__kernel __attribute__((reqd_work_group_size(BK * BC / 4, 1, 1)))                                  \
void NAME(const int K, const int C, const int T, const int TH, const int TW, const int chunk,      \
          const int width, __global const float* g, __global const float* x,                       \
          __global float* parts, const int g_mode, const int x_mode, WINDOW_ARGS) {                \
    const int THREADS = BK * BC / 4;                                                               \
    __local float4 lds[16 * WINO_CK * (BK + BC) / 4];                                              \
    __local float4* ys = lds;                                                                      \
    __local float4* vs = lds + 16 * WINO_CK * BK / 4;                                              \
    __local float* o = (__local float*)lds;                                                        \
    const int tid = get_local_id(0), ga = tid % (BK / 8), gb = tid / (BK / 8) % (BC / 8);          \
    const int xi = tid / (BK * BC / 64), SUM_A = xi == 5;                                          \
    const int split = get_group_id(0), c0 = get_group_id(1) * BC, k0 = get_group_id(2) * BK;       \
    const int first = split * chunk, end = min(T, first + chunk), plane = TH * TW;                 \
    float acc[8][8], sum_a[8];                                                                     \
    _Pragma("unroll") for (int i = 0; i < 8; ++i) {                                                \
        sum_a[i] = 0.0f;                                                                           \
        _Pragma("unroll") for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;                            \
    }                                                                                              \
    for (int t0 = first; t0 < end; t0 += WINO_CK) {                                                \
        __local float* yf = (__local float*)ys;                                                    \
        __local float* vf = (__local float*)vs;                                                    \
        for (int e = tid; e < WINO_CK * BK; e += THREADS) {                                        \
            const int t = e % WINO_CK, kk = e / WINO_CK, tile = t0 + t, k = k0 + kk;               \
            float dy[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};                                         \
            if (tile < end && k < K) {                                                             \
                const int n = tile / plane, th = (tile - n * plane) / TW;                          \
                const int tw = tile - n * plane - th * TW;                                         \
                const size_t p = ((size_t)n * K + k) * OH * OW;                                    \
                _Pragma("unroll") for (int a = 0; a < 2; ++a)                                      \
                    _Pragma("unroll") for (int b = 0; b < 2; ++b) {                                \
                        const int oh = 2 * th + a, ow = 2 * tw + b;                                \
                        if (oh < OH && ow < OW) dy[a][b] = wino_load(g, p + oh * OW + ow, g_mode); \
                    }                                                                              \
            }                                                                                      \
            float z[4][2];  /* A dy, then each row times A^T */                                    \
            _Pragma("unroll") for (int b = 0; b < 2; ++b) {                                        \
                z[0][b] = dy[0][b]; z[1][b] = dy[0][b] + dy[1][b];                                 \
                z[2][b] = dy[0][b] - dy[1][b]; z[3][b] = -dy[1][b];                                \
            }                                                                                      \
            const int at = kk ^ (4 * t);                                                           \
            _Pragma("unroll") for (int r = 0; r < 4; ++r) {                                        \
                const float y4[4] = {z[r][0], z[r][0] + z[r][1], z[r][0] - z[r][1], -z[r][1]};     \
                _Pragma("unroll") for (int s = 0; s < 4; ++s)                                      \
                    yf[((4 * r + s) * WINO_CK + t) * BK + at] = y4[s];                             \
            }                                                                                      \
        }                                                                                          \
        for (int e = tid; e < WINO_CK * BC * 2; e += THREADS) {                                    \
            const int t = e % WINO_CK, ck = e / WINO_CK % BC, upper = e / (WINO_CK * BC);          \
            const int tile = t0 + t, c = c0 + ck;                                                  \
            float v[8];                                                                            \
            if (tile < end && c < C) {                                                             \
                const int n = tile / plane, th = (tile - n * plane) / TW;                          \
                const int tw = tile - n * plane - th * TW;                                         \
                wino_input_half(x, ((size_t)n * C + c) * H * W, x_mode, 2 * th - PH, 2 * tw - PW,  \
                                H, W, upper, v);                                                   \
            } else {                                                                               \
                _Pragma("unroll") for (int k = 0; k < 8; ++k) v[k] = 0.0f;                         \
            }                                                                                      \
            _Pragma("unroll") for (int k = 0; k < 8; ++k)                                          \
                vf[((8 * upper + k) * WINO_CK + t) * BC + (ck ^ (4 * t))] = v[k];                  \
        }                                                                                          \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
        WINO_PRODUCTS(ys, vs, BK, BC, 1, WINO_CK)                                                  \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
    }                                                                                              \
    __global float* part = parts + (size_t)split * K * width;                                      \
    if (SUM_A && gb == 0 && c0 == 0 && width > C * 9) {                                            \
        for (int i = 0; i < 8; ++i) {                                                              \
            const int k = k0 + 4 * ga + i % 4 + (BK / 2) * (i / 4);                                \
            if (k < K) part[k * width + C * 9] = sum_a[i];                                         \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < 4; ++r) {                                                                  \
        float m16[16];                                                                             \
        WINO_GATHER(r, o, BK, BC, m16, row)                                                        \
        const int k = k0 + row, c = c0 + cc;                                                       \
        if (k < K && c < C) {                                                                      \
            float t[3][4];  /* G^T S */                                                            \
            _Pragma("unroll") for (int s = 0; s < 4; ++s) {                                        \
                const float mid = 0.5f * (m16[4 + s] + m16[8 + s]);                                \
                t[0][s] = m16[s] + mid;                                                            \
                t[1][s] = 0.5f * (m16[4 + s] - m16[8 + s]);                                        \
                t[2][s] = mid + m16[12 + s];                                                       \
            }                                                                                      \
            __global float* dw = part + k * width + c * 9;                                         \
            _Pragma("unroll") for (int a = 0; a < 3; ++a) {                                        \
                const float mid = 0.5f * (t[a][1] + t[a][2]);                                      \
                dw[3 * a] = t[a][0] + mid;                                                         \
                dw[3 * a + 1] = 0.5f * (t[a][1] - t[a][2]);                                        \
                dw[3 * a + 2] = mid + t[a][3];                                                     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}
CONV_WINOGRAD_WGRAD(conv_winograd_wgrad_64x32, 64, 32)
#endif  // WINOGRAD

// x (A, B, L) from element x_offset -> out (B, A, L) from element out_offset, + bias (A) when
// has_bias: conv2d's GEMM output (K, N, OH*OW) into NCHW (swap_axes01: x float, out act_t,
// conv2d's output), and its gradient back (swap_axes01_act: x and out act_t, the gradient
// in its own storage).
#define SWAP_AXES01(NAME, X_T)                                                                 \
__kernel void NAME(const int A, const int B, const int L, const int x_offset,                  \
                   const int out_offset, const int has_bias, __global const X_T* x,            \
                   __global const float* bias, __global act_t* out) {                          \
    const int i = get_global_id(0);                                                            \
    if (i >= A * B * L) return;                                                                \
    const int q = i / L, l = i - q * L, b = q / A, a = q - b * A;                              \
    STORE(out, out_offset + i,                                                                 \
          LOAD_##X_T(x, x_offset + (a * B + b) * L + l) + (has_bias ? bias[a] : 0.0f));        \
}
SWAP_AXES01(swap_axes01, float)
SWAP_AXES01(swap_axes01_act, act_t)

// The start of a pooling kernel's forward pass, for output pixel i (planes, OH, OW): `plane`,
// the plane of x it reads, and its window's real pixels, rows [h_start, h_end) and columns
// [w_start, w_end) (the padding left out).
#define POOL_WINDOW(x, i)                                                                      \
    const int ow = (i) % OW, oh = ((i) / OW) % OH;                                             \
    __global const act_t* plane = (x) + ((i) / (OH * OW)) * H * W;                             \
    const int h0 = oh * SH - PH, w0 = ow * SW - PW;                                            \
    const int h_start = h0 > 0 ? h0 : 0, h_end = h0 + R < H ? h0 + R : H;                      \
    const int w_start = w0 > 0 ? w0 : 0, w_end = w0 + S < W ? w0 + S : W;

// The start of its backward pass, for input pixel i (planes, H, W) at (h, w) in its plane:
// `base`, where the plane's outputs start, and the outputs whose window covers the pixel,
// rows oh_lo..oh_hi and columns ow_lo..ow_hi.
#define POOL_COVERING(i)                                                                       \
    const int w = (i) % W, h = ((i) / W) % H, base = ((i) / (H * W)) * OH * OW;                \
    COVERING(h + PH, R, SH, OH, oh_lo, oh_hi)                                                  \
    COVERING(w + PW, S, SW, OW, ow_lo, ow_hi)

// x (planes, H, W) -> out, argmax (planes, OH, OW): the window's maximum over its real pixels
// (padding is -inf) and the index h * W + w of the first one, as PyTorch; NaN wins, the first.
// x and out are act_t.
__kernel void max_pool2d_fwd(const int planes, WINDOW_ARGS, __global const act_t* x,
                             __global act_t* out, __global int* argmax) {
    const int i = get_global_id(0);
    if (i >= planes * OH * OW) return;
    POOL_WINDOW(x, i)
    float best = -INFINITY;
    int best_at = h_start * W + w_start;
    for (int h = h_start; h < h_end; ++h) {
        for (int w = w_start; w < w_end; ++w) {
            const float v = LOAD(plane, h * W + w);
            if (v > best || (isnan(v) && !isnan(best))) { best = v; best_at = h * W + w; }
        }
    }
    STORE(out, i, best);
    argmax[i] = best_at;
}

// g, argmax (planes, OH, OW) -> dx (planes, H, W): each pixel sums g over the windows it won.
// g and dx act_t.
__kernel void max_pool2d_bwd(const int planes, WINDOW_ARGS, __global const act_t* g,
                             __global const int* argmax, __global act_t* dx) {
    const int i = get_global_id(0);
    if (i >= planes * H * W) return;
    POOL_COVERING(i)
    float acc = 0.0f;
    for (int oh = oh_lo; oh <= oh_hi; ++oh)
        for (int ow = ow_lo; ow <= ow_hi; ++ow) {
            const int j = base + oh * OW + ow;
            acc += argmax[j] == h * W + w ? LOAD(g, j) : 0.0f;
        }
    STORE(dx, i, acc);
}

// x (planes, H, W) -> out (planes, OH, OW): the window's sum / (R*S), padded zeros counted.
// x and out are act_t.
__kernel void avg_pool2d_fwd(const int planes, WINDOW_ARGS, __global const act_t* x,
                             __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= planes * OH * OW) return;
    POOL_WINDOW(x, i)
    float acc = 0.0f;
    for (int h = h_start; h < h_end; ++h)
        for (int w = w_start; w < w_end; ++w) acc += LOAD(plane, h * W + w);
    STORE(out, i, acc / (float)(R * S));
}

// g (planes, OH, OW) -> dx (planes, H, W): each pixel sums g / (R*S) over its windows. g and
// dx act_t.
__kernel void avg_pool2d_bwd(const int planes, WINDOW_ARGS, __global const act_t* g,
                             __global act_t* dx) {
    const int i = get_global_id(0);
    if (i >= planes * H * W) return;
    POOL_COVERING(i)
    float acc = 0.0f;
    for (int oh = oh_lo; oh <= oh_hi; ++oh)
        for (int ow = ow_lo; ow <= ow_hi; ++ow) acc += LOAD(g, base + oh * OW + ow);
    STORE(dx, i, acc / (float)(R * S));
}

// --- dropout ---------------------------------------------------------------------------------
// The keep mask is a hash of (seed, i), so backward recomputes it instead of storing it, and
// the NumPy backend computes the very same mask (netcl.py: _dropout_keep).
uint fmix32(uint h) {  // MurmurHash3's finaliser: a cheap, well-mixed 32-bit hash
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

// out (n) = x * scale where uniform(seed, i) >= p, else 0. Forward and backward alike, x and
// out act_t (a gradient in the float build, or float16 storage in the half one).
__kernel void dropout_mask(const int n, const uint seed, const float p, const float scale,
                           __global const act_t* x, __global act_t* out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const float u = (float)(fmix32((uint)i * 0x9E3779B1u + fmix32(seed)) >> 8) * (1.0f / 16777216.0f);
    STORE(out, i, u >= p ? LOAD(x, i) * scale : 0.0f);
}

// --- normalisation, embedding and attention --------------------------------------------------
// Statistics take two passes (the mean, then the mean squared deviation); every sum over rows
// is a gather in a fixed order, never an atomic. Inputs are act_t; outputs, statistics and
// gradients are float.

// One work-group of NORM_GROUP work-items per row: each sums every NORM_GROUP-th element,
// then group_sum adds the partial sums (the columns of a row are contiguous, so the group's
// loads are too).
#define NORM_GROUP 64

// x (rows, D) -> y (rows, D) = (x - mean) * rstd [* weight] [+ bias], rstd = 1 / sqrt(biased
// variance + eps); mean and rstd (rows) are kept for backward.
__kernel __attribute__((reqd_work_group_size(NORM_GROUP, 1, 1)))
void layer_norm_fwd(const int rows, const int D, const float eps, const int has_weight,
                    const int has_bias, __global const act_t* x, __global const float* weight,
                    __global const float* bias, __global float* y, __global float* mean,
                    __global float* rstd) {
    __local float partial[NORM_GROUP];
    const int r = get_group_id(0), lid = get_local_id(0);
    __global const act_t* row = x + r * D;
    float acc = 0.0f;
    for (int j = lid; j < D; j += NORM_GROUP) acc += LOAD(row, j);
    const float mu = group_sum(partial, acc) / (float)D;
    acc = 0.0f;
    for (int j = lid; j < D; j += NORM_GROUP) { const float d = LOAD(row, j) - mu; acc += d * d; }
    const float r_std = 1.0f / sqrt(group_sum(partial, acc) / (float)D + eps);
    for (int j = lid; j < D; j += NORM_GROUP) {
        float value = (LOAD(row, j) - mu) * r_std;
        if (has_weight) value *= weight[j];
        if (has_bias) value += bias[j];
        y[r * D + j] = value;
    }
    if (lid == 0) {
        mean[r] = mu;
        rstd[r] = r_std;
    }
}

// g (rows, D) -> dx (rows, D) = rstd (d - mean(d) - x_hat mean(d x_hat)), d = g [* weight],
// x_hat = (x - mean) * rstd.
__kernel __attribute__((reqd_work_group_size(NORM_GROUP, 1, 1)))
void layer_norm_bwd_dx(const int rows, const int D, const int has_weight,
                       __global const float* g, __global const act_t* x,
                       __global const float* weight, __global const float* mean,
                       __global const float* rstd, __global float* dx) {
    __local float partial[NORM_GROUP];
    const int r = get_group_id(0), lid = get_local_id(0);
    __global const act_t* row = x + r * D;
    const float mu = mean[r], r_std = rstd[r];
    float acc_d = 0.0f, acc_d_x_hat = 0.0f;
    for (int j = lid; j < D; j += NORM_GROUP) {
        const float d = has_weight ? g[r * D + j] * weight[j] : g[r * D + j];
        acc_d += d;
        acc_d_x_hat += d * (LOAD(row, j) - mu) * r_std;
    }
    const float mean_d = group_sum(partial, acc_d) / (float)D;
    const float mean_d_x_hat = group_sum(partial, acc_d_x_hat) / (float)D;
    for (int j = lid; j < D; j += NORM_GROUP) {
        const float d = has_weight ? g[r * D + j] * weight[j] : g[r * D + j];
        const float x_hat = (LOAD(row, j) - mu) * r_std;
        dx[r * D + j] = r_std * (d - mean_d - x_hat * mean_d_x_hat);
    }
}

// g, x (rows, D) -> dweight, dbias (chunks, D): the sums of g x_hat and of g over each chunk of
// rows_per_chunk rows, as sum_columns sums (grid (columns, lanes * chunks)); netcl.py sums
// the chunks when there is more than one.
__kernel __attribute__((reqd_work_group_size(COLUMN_LANES, COLUMN_LANES, 1)))
void layer_norm_bwd_params(const int rows, const int D, const int rows_per_chunk,
                           __global const float* g, __global const act_t* x,
                           __global const float* mean, __global const float* rstd,
                           __global float* dweight, __global float* dbias) {
    __local float part_w[COLUMN_LANES][COLUMN_LANES + 1], part_b[COLUMN_LANES][COLUMN_LANES + 1];
    const int j = get_global_id(0), c = get_local_id(0), lane = get_local_id(1);
    const int chunk = get_group_id(1), first = chunk * rows_per_chunk;
    const int end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    float acc_w = 0.0f, acc_b = 0.0f;
    if (j < D) {
        for (int r = first + lane; r < end; r += COLUMN_LANES) {
            const float gv = g[r * D + j];
            acc_w += gv * (LOAD(x, r * D + j) - mean[r]) * rstd[r];
            acc_b += gv;
        }
    }
    part_w[lane][c] = acc_w;
    part_b[lane][c] = acc_b;
    sum_over_lanes(part_w, lane, c);
    sum_over_lanes(part_b, lane, c);
    if (lane == 0 && j < D) {
        dweight[chunk * D + j] = part_w[0][c];
        dbias[chunk * D + j] = part_b[0][c];
    }
}

// Batch norm sees x as (N, C, L) and reduces each channel over N and L: n = N * L values.
#define CHANNEL_AT(j) ((((j) / L) * C + c) * L + (j) % L)

// x (N, C, L) -> mean, var (C): the batch's mean and biased variance, one work-group per
// channel; when `update`, running_mean and running_var (C) move towards them by momentum,
// the variance unbiased (n / (n - 1)), as PyTorch.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void batch_norm_stats(const int N, const int C, const int L, const float momentum,
                      const int update, __global const act_t* x, __global float* mean,
                      __global float* var, __global float* running_mean,
                      __global float* running_var) {
    __local float partial[256];
    const int c = get_group_id(0), lid = get_local_id(0), n = N * L;
    float acc = 0.0f;
    for (int j = lid; j < n; j += 256) acc += LOAD(x, CHANNEL_AT(j));
    const float mu = group_sum(partial, acc) / (float)n;
    acc = 0.0f;
    for (int j = lid; j < n; j += 256) {
        const float d = LOAD(x, CHANNEL_AT(j)) - mu;
        acc += d * d;
    }
    const float v = group_sum(partial, acc) / (float)n;
    if (lid == 0) {
        mean[c] = mu;
        var[c] = v;
        if (update) {
            running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mu;
            running_var[c] = (1.0f - momentum) * running_var[c]
                             + momentum * v * ((float)n / (float)(n - 1));
        }
    }
}

// x (N, C, L) -> y = (x - mean[c]) / sqrt(var[c] + eps) [* weight[c]] [+ bias[c]], n = N*C*L.
__kernel void batch_norm_fwd(const int n, const int C, const int L, const float eps,
                             const int has_weight, const int has_bias, __global const act_t* x,
                             __global const float* mean, __global const float* var,
                             __global const float* weight, __global const float* bias,
                             __global float* y) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const int c = (i / L) % C;
    float value = (LOAD(x, i) - mean[c]) / sqrt(var[c] + eps);
    if (has_weight) value *= weight[c];
    if (has_bias) value += bias[c];
    y[i] = value;
}

// g, x (N, C, L) -> sum_g, sum_g_x_hat (C): the bias's and the weight's gradients, one
// work-group per channel.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void batch_norm_bwd_sums(const int N, const int C, const int L, const float eps,
                         __global const float* g, __global const act_t* x,
                         __global const float* mean, __global const float* var,
                         __global float* sum_g, __global float* sum_g_x_hat) {
    __local float partial[256];
    const int c = get_group_id(0), lid = get_local_id(0), n = N * L;
    const float mu = mean[c], r_std = 1.0f / sqrt(var[c] + eps);
    float acc_g = 0.0f, acc_g_x_hat = 0.0f;
    for (int j = lid; j < n; j += 256) {
        const int at = CHANNEL_AT(j);
        acc_g += g[at];
        acc_g_x_hat += g[at] * (LOAD(x, at) - mu) * r_std;
    }
    const float total_g = group_sum(partial, acc_g);
    const float total_g_x_hat = group_sum(partial, acc_g_x_hat);
    if (lid == 0) { sum_g[c] = total_g; sum_g_x_hat[c] = total_g_x_hat; }
}

// g (N, C, L) -> dx = weight rstd (g - (sum_g + x_hat sum_g_x_hat) / n) with batch statistics
// (batch_stats: the mean and variance depend on x), weight rstd g with running ones.
// inv_count = 1 / (N * L); n = N * C * L.
__kernel void batch_norm_bwd_dx(const int n, const int C, const int L, const float inv_count,
                                const float eps, const int batch_stats, const int has_weight,
                                __global const float* g, __global const act_t* x,
                                __global const float* mean, __global const float* var,
                                __global const float* weight, __global const float* sum_g,
                                __global const float* sum_g_x_hat, __global float* dx) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const int c = (i / L) % C;
    const float r_std = 1.0f / sqrt(var[c] + eps);
    const float scale = has_weight ? weight[c] * r_std : r_std;
    float d = g[i];
    if (batch_stats) {
        const float x_hat = (LOAD(x, i) - mean[c]) * r_std;
        d -= (sum_g[c] + x_hat * sum_g_x_hat[c]) * inv_count;
    }
    dx[i] = scale * d;
}

// weight (num, dim), idx (n / dim) -> out (n / dim, dim) = the rows idx picks; n = out's size.
__kernel void embedding_fwd(const int n, const int dim, __global const int* idx,
                            __global const float* weight, __global float* out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const int position = i / dim;
    out[i] = weight[idx[position] * dim + (i - position * dim)];
}

// g (positions, dim) -> dweight (num, dim): row r sums the rows of g at the positions that
// picked it, order[starts[r]] .. order[starts[r + 1] - 1] (positions sorted by index, stably,
// on the host), so each sum runs in position order. One work-item per (row, column).
__kernel void embedding_bwd(const int num, const int dim, __global const int* runs,
                            __global const float* g, __global float* dweight) {
    // runs: where each row's run starts (num + 1), then the positions sorted by row
    __global const int* starts = runs;
    __global const int* order = runs + num + 1;
    const int i = get_global_id(0);
    if (i >= num * dim) return;
    const int row = i / dim, col = i - row * dim;
    float acc = 0.0f;
    for (int j = starts[row]; j < starts[row + 1]; ++j) acc += g[order[j] * dim + col];
    dweight[i] = acc;
}

// Attention over q (B, L, E), k (B, S, E), v (B, S, Ev) (act_t). The score of query row l
// against key s is scale q.k plus the mask (float, added), or -inf when causal and s > l. The
// mask of (b, l, s) is at ((b / mask_div) % mask_mod) * mask_stride_b + l * mask_stride_l +
// s * mask_stride_s: broadcast dimensions have stride 0. A kept weight is scaled by
// dropout_scale; the keep test is dropout_mask's hash of (seed, (b * L + l) * S + s).
#define ATTENTION_ARGS const int B, const int L, const int S, const int E, const int Ev,          \
    const float scale, const int causal, const int has_mask, const int mask_div,                 \
    const int mask_mod, const int mask_stride_b, const int mask_stride_l,                        \
    const int mask_stride_s, const float dropout_p, const float dropout_scale, const uint seed
#define MASK_AT(b, l, s) (((b) / mask_div) % mask_mod * mask_stride_b + (l) * mask_stride_l      \
                          + (s) * mask_stride_s)
#define SCORE(b, l, s, q_row, k_row, out)                                                       \
    if (causal && (s) > (l)) { out = -INFINITY; } else {                                         \
        float dot_ = 0.0f;                                                                       \
        for (int e = 0; e < E; ++e) dot_ += LOAD(q_row, e) * LOAD(k_row, e);                     \
        out = scale * dot_ + (has_mask ? mask[MASK_AT(b, l, s)] : 0.0f);                         \
    }
#define DROPOUT_FACTOR(b, l, s)                                                                  \
    (dropout_p == 0.0f ? 1.0f :                                                                  \
     (float)(fmix32((uint)(((b) * L + (l)) * S + (s)) * 0x9E3779B1u + fmix32(seed)) >> 8)       \
         * (1.0f / 16777216.0f) >= dropout_p ? dropout_scale : 0.0f)

// One work-group of ATTENTION_GROUP work-items per query row (forward, dq) or key row (dk,
// dv): the work-items share the row's scores, a block of ATTENTION_GROUP at a time, in local
// memory, and split the output's columns between them (each adds a block's sum to its own
// columns); every sum runs in a fixed order. When causal, query row l attends to keys 0..l
// only, so the loops stop there.
#define ATTENTION_GROUP 64

// out_row[e] += sum over the block's rows j of factors[j] * rows[j * n + e], for each column e
// this work-item owns (lid, lid + ATTENTION_GROUP, ...); READ is LOAD (act_t) or PLAIN.
#define ADD_BLOCK_PRODUCT(out_row, n, factors, block, rows, READ)                               \
    for (int e = lid; e < (n); e += ATTENTION_GROUP) {                                           \
        float acc_ = 0.0f;                                                                       \
        for (int j = 0; j < (block); ++j) acc_ += (factors)[j] * READ(rows, j * (n) + e);        \
        (out_row)[e] += acc_;                                                                    \
    }
#define PLAIN(p, i) (p)[i]

// The log-sum-exp of (top, total) pairs, one per work-item, merged in local memory: every
// work-item returns the row's. total is the sum of exp(score - top) over the scores seen.
float group_logsumexp(float top, float total, __local float* tops, __local float* totals) {
    const int lid = get_local_id(0);
    tops[lid] = top;
    totals[lid] = total;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = ATTENTION_GROUP / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            const float a = tops[lid], b = tops[lid + stride];
            const float m = fmax(a, b);
            totals[lid] = m == -INFINITY ? 0.0f
                        : totals[lid] * exp(a - m) + totals[lid + stride] * exp(b - m);
            tops[lid] = m;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float m = tops[0], t = totals[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // tops and totals are free for the caller again
    return m == -INFINITY ? INFINITY : m + log(t);
}

// -> out (B, L, Ev) = sum_s exp(score - lse) dropout v[s], lse (B, L) each row's log-sum-exp
// (+inf for a row with no key to attend to: its weights are then all 0, PyTorch's output 0).
// The max and the sum in one pass (online, per work-item, then merged), then the output: each
// block of weights in local memory, each work-item summing its columns over the block.
__kernel __attribute__((reqd_work_group_size(ATTENTION_GROUP, 1, 1)))
void attention_fwd(ATTENTION_ARGS, __global const act_t* q, __global const act_t* k,
                   __global const act_t* v, __global const float* mask,
                   __global float* out, __global float* lse) {
    __local float tops[ATTENTION_GROUP], totals[ATTENTION_GROUP], weights[ATTENTION_GROUP];
    const int i = get_group_id(0), lid = get_local_id(0);
    const int b = i / L, l = i - b * L;
    const int keys = causal ? min(S, l + 1) : S;
    __global const act_t* q_row = q + i * E;
    float top = -INFINITY, total = 0.0f, score;
    for (int s = lid; s < keys; s += ATTENTION_GROUP) {
        SCORE(b, l, s, q_row, k + (b * S + s) * E, score)
        if (score > top) { total = total * exp(top - score) + 1.0f; top = score; }
        else if (score > -INFINITY) total += exp(score - top);
    }
    const float row_lse = group_logsumexp(top, total, tops, totals);
    __global float* out_row = out + i * Ev;  // each work-item owns columns lid, lid + GROUP, ...
    for (int e = lid; e < Ev; e += ATTENTION_GROUP) out_row[e] = 0.0f;
    for (int s0 = 0; s0 < keys; s0 += ATTENTION_GROUP) {
        const int s = s0 + lid;
        float weight = 0.0f;
        if (s < keys) {
            SCORE(b, l, s, q_row, k + (b * S + s) * E, score)
            weight = exp(score - row_lse) * DROPOUT_FACTOR(b, l, s);
        }
        weights[lid] = weight;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int block = min(ATTENTION_GROUP, keys - s0);
        ADD_BLOCK_PRODUCT(out_row, Ev, weights, block, v + (b * S + s0) * Ev, LOAD)
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) lse[i] = row_lse;
}

// g (B, L, Ev) -> dq (B, L, E) = scale sum_s P (D g.v[s] - delta) k[s], delta (B, L) = g.out:
// P = exp(score - lse) recomputed, D the dropout factor. Per block of keys, each work-item
// finds one key's factor P (D g.v - delta), then sums its columns of dq over the block.
__kernel __attribute__((reqd_work_group_size(ATTENTION_GROUP, 1, 1)))
void attention_bwd_q(ATTENTION_ARGS, __global const act_t* q, __global const act_t* k,
                     __global const act_t* v, __global const float* mask,
                     __global const float* g, __global const float* out,
                     __global const float* lse, __global float* delta, __global float* dq) {
    __local float factors[ATTENTION_GROUP];
    const int i = get_group_id(0), lid = get_local_id(0);
    const int b = i / L, l = i - b * L;
    const int keys = causal ? min(S, l + 1) : S;
    __global const act_t* q_row = q + i * E;
    __global const float* g_row = g + i * Ev;
    float partial_delta = 0.0f;
    for (int e = lid; e < Ev; e += ATTENTION_GROUP) partial_delta += g_row[e] * out[i * Ev + e];
    const float row_delta = group_sum(factors, partial_delta);
    const float row_lse = lse[i];
    __global float* dq_row = dq + i * E;  // each work-item owns columns lid, lid + GROUP, ...
    for (int e = lid; e < E; e += ATTENTION_GROUP) dq_row[e] = 0.0f;
    float score;
    for (int s0 = 0; s0 < keys; s0 += ATTENTION_GROUP) {
        const int s = s0 + lid;
        float factor = 0.0f;
        if (s < keys) {
            SCORE(b, l, s, q_row, k + (b * S + s) * E, score)
            const float p = exp(score - row_lse);
            if (p != 0.0f) {
                __global const act_t* v_row = v + (b * S + s) * Ev;
                float g_dot_v = 0.0f;
                for (int e = 0; e < Ev; ++e) g_dot_v += g_row[e] * LOAD(v_row, e);
                factor = p * (g_dot_v * DROPOUT_FACTOR(b, l, s) - row_delta);
            }
        }
        factors[lid] = factor;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int block = min(ATTENTION_GROUP, keys - s0);
        ADD_BLOCK_PRODUCT(dq_row, E, factors, block, k + (b * S + s0) * E, LOAD)
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int e = lid; e < E; e += ATTENTION_GROUP) dq_row[e] *= scale;
    if (lid == 0) delta[i] = row_delta;
}

// -> dk (B, S, E) = scale sum_l P (D g[l].v - delta[l]) q[l], dv (B, S, Ev) = sum_l P D g[l]:
// one work-group per key row; per block of query rows, each work-item finds one row's two
// factors, then sums its columns of dk and dv over the block, in query order (no atomics).
__kernel __attribute__((reqd_work_group_size(ATTENTION_GROUP, 1, 1)))
void attention_bwd_kv(ATTENTION_ARGS, __global const act_t* q, __global const act_t* k,
                      __global const act_t* v, __global const float* mask,
                      __global const float* g, __global const float* lse,
                      __global const float* delta, __global float* dk, __global float* dv) {
    __local float k_factors[ATTENTION_GROUP], v_factors[ATTENTION_GROUP];
    const int i = get_group_id(0), lid = get_local_id(0);
    const int b = i / S, s = i - b * S;
    const int first = causal ? min(s, L) : 0;  // causal: queries before s do not see key s
    __global const act_t* k_row = k + i * E;
    __global const act_t* v_row = v + i * Ev;
    __global float* dk_row = dk + i * E;  // each work-item owns columns lid, lid + GROUP, ...
    __global float* dv_row = dv + i * Ev;
    for (int e = lid; e < E; e += ATTENTION_GROUP) dk_row[e] = 0.0f;
    for (int e = lid; e < Ev; e += ATTENTION_GROUP) dv_row[e] = 0.0f;
    float score;
    for (int l0 = first; l0 < L; l0 += ATTENTION_GROUP) {
        const int l = l0 + lid;
        float k_factor = 0.0f, v_factor = 0.0f;
        if (l < L) {
            SCORE(b, l, s, q + (b * L + l) * E, k_row, score)
            const float p = exp(score - lse[b * L + l]);
            if (p != 0.0f) {
                __global const float* g_row = g + (b * L + l) * Ev;
                const float drop = DROPOUT_FACTOR(b, l, s);
                float g_dot_v = 0.0f;
                for (int e = 0; e < Ev; ++e) g_dot_v += g_row[e] * LOAD(v_row, e);
                k_factor = p * (g_dot_v * drop - delta[b * L + l]);
                v_factor = p * drop;
            }
        }
        k_factors[lid] = k_factor;
        v_factors[lid] = v_factor;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int block = min(ATTENTION_GROUP, L - l0);
        ADD_BLOCK_PRODUCT(dk_row, E, k_factors, block, q + (b * L + l0) * E, LOAD)
        ADD_BLOCK_PRODUCT(dv_row, Ev, v_factors, block, g + (b * L + l0) * Ev, PLAIN)
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int e = lid; e < E; e += ATTENTION_GROUP) dk_row[e] *= scale;
}

// ============================================================================ optimizers

// SGD as torch/optim/sgd.py (dampening 0): d = g + wd p; buf = first ? d : momentum buf + d;
// d = nesterov ? d + momentum buf : buf; p -= lr d. p, g, buf (n). With has_found_inf, a
// nonzero found_inf (1) (an AMPGradScaler's) makes the step a no-op.
__kernel void sgd_step(const int n, const float lr, const float momentum, const float weight_decay,
                       const int nesterov, const int first_step, const int has_found_inf,
                       __global const int* found_inf, __global float* p,
                       __global const float* g, __global float* buf) {
    const int i = get_global_id(0);
    if (i >= n || (has_found_inf && found_inf[0])) return;
    float d = g[i] + weight_decay * p[i];
    if (momentum != 0.0f) {
        const float b = first_step ? d : momentum * buf[i] + d;
        buf[i] = b;
        d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
}

// --- gradient norms and clip_grad_norm -------------------------------------------------------
// Stage one: partials[first + group] = sum of |x|^norm_type over the elements this work-group
// visits (the maximum of |x| for the inf-norm). Stage two (total_norm) combines the partials
// of all tensors inside the kernel that needs the norm. NaN propagates through both, as
// through PyTorch's norm: a NaN gradient gives a NaN norm.

// On a GPU the work-items stride over x, so neighbours read neighbouring elements. On a CPU
// device each work-item takes a run of its own instead, a multiple of 8 elements long, read
// in float8 vectors: PoCL ran the strided loop 4x slower (270K gradients: 450 against 100 µs).
// cpu_run is that run, [x, y), of n elements.
inline int2 cpu_run(const int n) {
    const int per = ((n + (int)get_global_size(0) - 1) / (int)get_global_size(0) + 7) & ~7;
    const int begin = min(n, (int)get_global_id(0) * per);
    return (int2)(begin, min(n, begin + per));
}

// The eight lanes of a float8 sum, added pairwise.
inline float lanes_sum(const float8 v) {
    return ((v.s0 + v.s1) + (v.s2 + v.s3)) + ((v.s4 + v.s5) + (v.s6 + v.s7));
}

// x (n) -> partials[first + group id]. The loops are specialised by norm type, so the
// common 2-norm is a plain multiply-add per element.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void norm_partials(const int n, const float norm_type, const int first, __global const float* x,
                   __global float* partials) {
    __local float scratch[256];
    const int stride = get_global_size(0);
    const int take_max = isinf(norm_type);
    float acc = 0.0f;
    if (norm_type == 2.0f) {
#if CPU_DEVICE  // amp_unscale sums the same squares in the same order
        const int2 run = cpu_run(n);
        float8 acc8 = 0.0f;
        int i = run.x;
        for (; i + 8 <= run.y; i += 8) { const float8 v = vload8(0, x + i); acc8 = fma(v, v, acc8); }
        for (; i < run.y; ++i) acc = fma(x[i], x[i], acc);
        acc += lanes_sum(acc8);
#else
        for (int i = get_global_id(0); i < n; i += stride) { const float v = x[i]; acc += v * v; }
#endif
    } else if (take_max) {
        for (int i = get_global_id(0); i < n; i += stride) acc = max_keeping_nan(acc, fabs(x[i]));
    } else {
        for (int i = get_global_id(0); i < n; i += stride) acc += pow(fabs(x[i]), norm_type);
    }
    const float total = group_reduce(scratch, acc, take_max);
    if (get_local_id(0) == 0) partials[first + get_group_id(0)] = total;
}

// partials (num_partials) -> the norm: (sum)^(1/norm_type), or the maximum for the inf-norm.
// Called by every work-item of one 256-wide group.
float total_norm(const int num_partials, const float norm_type, __global const float* partials,
                 __local float* scratch) {
    const int take_max = isinf(norm_type);
    float acc = 0.0f;
    for (int i = get_local_id(0); i < num_partials; i += 256)
        acc = take_max ? max_keeping_nan(acc, partials[i]) : acc + partials[i];
    const float total = group_reduce(scratch, acc, take_max);
    if (take_max) return total;
    return norm_type == 2.0f ? sqrt(total) : pow(total, 1.0f / norm_type);
}

// clip_grad_norm, on one work-group: partials (num_partials) -> total_norm (1) and
// clip_coef (1) = min(max_norm / (total_norm + 1e-6), 1), written so that NaN stays NaN.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void clip_coefficient(const int num_partials, const float norm_type, const float max_norm,
                      __global const float* partials, __global float* total_norm_out,
                      __global float* clip_coef) {
    __local float scratch[256];
    const float norm = total_norm(num_partials, norm_type, partials, scratch);
    if (get_local_id(0) != 0) return;
    const float coef = max_norm / (norm + 1e-6f);
    total_norm_out[0] = norm;
    clip_coef[0] = coef > 1.0f ? 1.0f : coef;
}

// x (n) *= scale[0]: a factor read from device memory, so the host never waits for it.
__kernel void scale_by_device_scalar(const int n, __global const float* scale, __global float* x) {
    const int i = get_global_id(0);
    if (i < n) x[i] *= scale[0];
}

// --- Adam and AdamW --------------------------------------------------------------------------
// A step is adam_prepare (one work-group), then adam_step over the flat buffers. scalars (4) =
// grad_scale, skip, 1 - beta1^t, sqrt(1 - beta2^t): everything the update needs that depends
// on device-side state, so the host never reads any of it.
//
// adam_prepare: with num_partials > 0 (step(max_norm=...)), the 2-norm of the gradients from
// their partials gives grad_scale = min(max_norm / (norm + 1e-6), 1), and a non-finite norm
// sets skip; without, grad_scale = 1. With has_found_inf, a nonzero found_inf (1) (an
// AMPGradScaler's inf check) sets skip too. step (1) counts the applied steps t: it advances
// only when the step is not skipped. 1 - beta^t = -expm1(t ln beta), accurate in float32.
// With `update` (an AMPGradScaler's fused step, after its unscaling pass), the same
// work-item also works out what the scaler's update() will make of its state, into spare
// buffers (update_scale_into, AMP section): update() then only swaps them on the host.
void update_scale_into(const float growth_factor, const float backoff_factor,
                       const int growth_interval, __global const int* state_found_inf,
                       __global const float* state_scale, __global const int* state_tracker,
                       __global int* found_inf_next, __global float* scale_next,
                       __global int* tracker_next);

__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void adam_prepare(const int num_partials, const float max_norm, const float log_beta1,
                  const float log_beta2, const int has_found_inf, __global const float* partials,
                  __global const int* found_inf, __global int* step, __global float* scalars,
                  const int update, const float growth_factor, const float backoff_factor,
                  const int growth_interval, __global const int* state_found_inf,
                  __global const float* state_scale, __global const int* state_tracker,
                  __global int* found_inf_next, __global float* scale_next,
                  __global int* tracker_next) {
    __local float scratch[256];
    float grad_scale = 1.0f;
    int skip = has_found_inf && found_inf[0];
    if (num_partials > 0) {
        const float norm = total_norm(num_partials, 2.0f, partials, scratch);
        const float coef = max_norm / (norm + 1e-6f);
        grad_scale = coef > 1.0f ? 1.0f : coef;
        skip = skip || !isfinite(norm);
    }
    if (get_local_id(0) != 0) return;
    const int t = step[0] + (skip ? 0 : 1);
    step[0] = t;
    scalars[0] = grad_scale;
    scalars[1] = skip ? 1.0f : 0.0f;
    scalars[2] = -expm1((float)t * log_beta1);
    scalars[3] = sqrt(-expm1((float)t * log_beta2));
    if (update)
        update_scale_into(growth_factor, backoff_factor, growth_interval, state_found_inf,
                          state_scale, state_tracker, found_inf_next, scale_next, tracker_next);
}

// torch/optim/adam.py's update on p, g, m (exp_avg), v (exp_avg_sq), all (n): the whole flat
// buffers, or one parameter's segments. Adam passes its L2 weight_decay and decay = 1; AdamW
// weight_decay = 0 and decay = 1 - lr * weight_decay (decoupled: p shrinks, g is unchanged).
// p_half, where it is not null, is the float16 copy of p that tensor cores read under
// autocast: written here with the new value, so no pass of its own re-rounds the weights.
__kernel void adam_step(const int n, const float lr, const float one_minus_beta1,
                        const float beta2, const float one_minus_beta2, const float eps,
                        const float weight_decay, const float decay,
                        __global const float* scalars, __global float* p,
                        __global const float* g, __global float* m, __global float* v,
                        __global half* p_half) {
    const int i = get_global_id(0);
    if (i >= n || scalars[1] != 0.0f) return;
    float grad = g[i] * scalars[0];
    if (weight_decay != 0.0f) grad += weight_decay * p[i];
    const float exp_avg = m[i] + one_minus_beta1 * (grad - m[i]);
    const float exp_avg_sq = v[i] * beta2 + one_minus_beta2 * grad * grad;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    const float step_size = lr / scalars[2];
    const float denom = sqrt(exp_avg_sq) / scalars[3] + eps;
    const float updated = p[i] * decay - step_size * (exp_avg / denom);
    p[i] = updated;
    if (p_half) vstore_half(updated, i, p_half);
}

// ============================================================================ mixed precision
// AMPGradScaler's device state: scale (1) float, growth_tracker (1) int, and found_inf flags
// (1) int, one per optimizer plus found_inf_any for the scaler. The host never reads them
// during training: the optimizer kernels read found_inf to skip, update_scale reads
// found_inf_any to back off or grow.

// AMPGradScaler.scale: out (n) float = x (n) * scale[0], x the loss (an activation, act_t)
// or the gradient flowing back into it; one launch for the copy and the product.
__kernel void times_scale(const int n, __global const float* scale, __global const act_t* x,
                          __global float* out) {
    const int i = get_global_id(0);
    if (i < n) out[i] = LOAD(x, i) * scale[0];
}

// 1 / x rounded as PyTorch's `scale.double().reciprocal().float()`. Division is not trusted
// here (OpenCL lets float division be off by 2.5 ulps, and a driver may lower a double one
// to an approximation): the float estimate is refined by Newton steps on FMAs, which round
// exactly by definition. With doubles, two steps give the reciprocal to double precision
// before its one rounding to float; without, one step in float rounds correctly but for
// rare ties.
float reciprocal_as_pytorch(const float x) {
    const float estimate = 1.0f / x;
#ifdef cl_khr_fp64
    const double xd = (double)x;
    double r = (double)estimate;
    r = fma(r, fma(-xd, r, 1.0), r);
    r = fma(r, fma(-xd, r, 1.0), r);
    return (float)r;
#else
    return fma(estimate, fma(-x, estimate, 1.0f), estimate);
#endif
}

// aten's _amp_foreach_non_finite_check_and_unscale_ on g (n): g *= 1 / scale[0] in place, and
// any inf or NaN sets found_inf (zeroed beforehand by the host's queue; null for the fused
// clip, which skips on the norm) and found_inf_any (zeroed by update_scale). The check tests
// each value, not a sum of squares, which could overflow from finite values. Work-items
// stride over g; one that saw a non-finite value sets the flags with atomic_or (several may:
// the result is the same).
// Where partials is not null, the pass also writes norm_partials' 2-norm partials of the
// unscaled g (partials[first + group id]), for the fused clip: the same grid, the same sums
// of the same values, so the same numbers as norm_partials run after it.
__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void amp_unscale(const int n, const int first, __global const float* scale, __global float* g,
                 __global int* found_inf, __global int* found_inf_any,
                 __global float* partials) {
    __local float scratch[256];
    const float inv_scale = reciprocal_as_pytorch(scale[0]);
    int found = 0;
    float acc = 0.0f;
#if CPU_DEVICE  // norm_partials' runs of float8 (see there)
    const int2 run = cpu_run(n);
    float8 acc8 = 0.0f;
    int8 bad = 0;
    int i = run.x;
    for (; i + 8 <= run.y; i += 8) {
        const float8 v = vload8(0, g + i), unscaled = v * inv_scale;
        bad |= isinf(v) | isnan(v);
        vstore8(unscaled, 0, g + i);
        acc8 = fma(unscaled, unscaled, acc8);
    }
    for (; i < run.y; ++i) {
        const float v = g[i], unscaled = v * inv_scale;
        found |= !isfinite(v);
        g[i] = unscaled;
        acc = fma(unscaled, unscaled, acc);
    }
    found |= any(bad);
    acc += lanes_sum(acc8);
#else
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) {
        const float v = g[i];
        found |= !isfinite(v);
        const float unscaled = v * inv_scale;
        g[i] = unscaled;
        acc += unscaled * unscaled;
    }
#endif
    if (found) {
        if (found_inf) atomic_or(found_inf, 1);
        atomic_or(found_inf_any, 1);
    }
    if (partials) {  // the same for every work-item: all of them reach the reduction's barriers
        const float total = group_reduce(scratch, acc, 0);
        if (get_local_id(0) == 0) partials[first + get_group_id(0)] = total;
    }
}

// aten's _amp_update_scale_, on one work-item: after a step with an inf/NaN gradient
// scale *= backoff_factor and the tracker restarts; after growth_interval clean steps in a
// row scale *= growth_factor (kept only if finite) and the tracker restarts. found_inf_any is
// then zeroed for the next step.
void update_scale(const float growth_factor, const float backoff_factor,
                  const int growth_interval, __global int* found_inf_any,
                  __global float* scale, __global int* growth_tracker) {
    if (found_inf_any[0]) {
        scale[0] = scale[0] * backoff_factor;
        growth_tracker[0] = 0;
    } else {
        const int successful = growth_tracker[0] + 1;
        if (successful == growth_interval) {
            const float grown = scale[0] * growth_factor;
            if (isfinite(grown)) scale[0] = grown;
            growth_tracker[0] = 0;
        } else {
            growth_tracker[0] = successful;
        }
    }
    found_inf_any[0] = 0;
}

// update_scale on a copy: the state (found_inf_any, scale, growth tracker) as it is, the
// updated state in the `_next` buffers (adam_prepare's `update`).
void update_scale_into(const float growth_factor, const float backoff_factor,
                       const int growth_interval, __global const int* state_found_inf,
                       __global const float* state_scale, __global const int* state_tracker,
                       __global int* found_inf_next, __global float* scale_next,
                       __global int* tracker_next) {
    found_inf_next[0] = state_found_inf[0];
    scale_next[0] = state_scale[0];
    tracker_next[0] = state_tracker[0];
    update_scale(growth_factor, backoff_factor, growth_interval, found_inf_next, scale_next,
                 tracker_next);
}

// AMPGradScaler.update, where it runs by itself (something read the scale before the next
// scale()).
__kernel void amp_update_scale(const float growth_factor, const float backoff_factor,
                               const int growth_interval, __global int* found_inf_any,
                               __global float* scale, __global int* growth_tracker) {
    if (get_global_id(0) != 0) return;
    update_scale(growth_factor, backoff_factor, growth_interval, found_inf_any, scale,
                 growth_tracker);
}

// AMPGradScaler.scale of a one-element loss x (1) (act_t) after an update() that has not run
// yet: the update, then out (1) float = x * the new scale, on one work-item, in one launch.
__kernel void amp_update_then_scale(const float growth_factor, const float backoff_factor,
                                    const int growth_interval, __global int* found_inf_any,
                                    __global float* scale, __global int* growth_tracker,
                                    __global const act_t* x, __global float* out) {
    if (get_global_id(0) != 0) return;
    update_scale(growth_factor, backoff_factor, growth_interval, found_inf_any, scale,
                 growth_tracker);
    out[0] = LOAD(x, 0) * scale[0];
}
