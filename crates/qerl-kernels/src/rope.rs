//! Rotary position embedding of a linear's output, fused with the move of its heads to the
//! front: `x [batch·seq, heads·d]` (token-major, as the q/k products write it) ->
//! `y [batch, heads, seq, d]` (head-major, as attention reads it), in the Hugging Face
//! "rotate half" convention, computing in f32 and rounding once.
//!
//! With the tables `c`, `s` `[batch·seq, d]` of a token and `h = d / 2`, for `i < h`:
//! `y[i] = x[i]·c[i] − x[i+h]·s[i]`, `y[i+h] = x[i+h]·c[i+h] + x[i]·s[i+h]`.
//! Backward (the transpose of that rotation, and of the move):
//! `dx[i] = dy[i]·c[i] + dy[i+h]·s[i+h]`, `dx[i+h] = dy[i+h]·c[i+h] − dy[i]·s[i]`.
//!
//! burn's ops take a slice, a negation, a concatenation, two products and a sum per tensor,
//! plus a copy to make the heads contiguous; here it is one kernel each way.

use crate::device::{check_buffer, grid_1d, linear_cube, shape_err, vector_width, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Units per cube.
const CUBE: u32 = 256;

/// The shape of one call: `tokens = batch · seq` rows of `heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl RopeShape {
    fn elems(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// The product's side: `[batch·seq, heads·d]`.
    pub fn token_major(&self) -> [usize; 2] {
        [self.batch * self.seq, self.heads * self.head_dim]
    }

    /// Attention's side: `[batch, heads, seq, d]`.
    pub fn head_major(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq, self.head_dim]
    }
}

/// One unit per vector of `V` pairs `(i, i + h)` of one (token, head); `backward` picks the
/// direction: `false` reads token-major `x` and writes head-major `y`, `true` reads head-major
/// `dy` and writes token-major `dx` with the transposed rotation.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, V: Size>(
    input: &Array<Vector<F, V>>,
    cos: &Array<Vector<F, V>>,
    sin: &Array<Vector<F, V>>,
    output: &mut Array<Vector<F, V>>,
    seq: u32,
    heads: u32,
    half_vecs: u32,
    units: u32,
    #[comptime] backward: bool,
) {
    let u = linear_cube() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if u < units as usize {
        let (seq, heads, hv) = (seq as usize, heads as usize, half_vecs as usize);
        // u = ((token · heads) + head) · hv + j
        let j = u % hv;
        let head = (u / hv) % heads;
        let token = u / (hv * heads);
        let (b, t) = (token / seq, token % seq);
        let dv = 2 * hv;
        let token_major = (token * heads + head) * dv + j;
        let head_major = ((b * heads + head) * seq + t) * dv + j;
        let table = token * dv + j;
        let (c_lo, c_hi) = (cos[table], cos[table + hv]);
        let (s_lo, s_hi) = (sin[table], sin[table + hv]);
        let src = if backward { head_major } else { token_major };
        let dst = if backward { token_major } else { head_major };
        let (lo, hi) = (input[src], input[src + hv]);
        let mut out_lo = Vector::<F, V>::empty();
        let mut out_hi = Vector::<F, V>::empty();
        #[unroll]
        for e in 0..input.vector_size() {
            let (a, z) = (f32::cast_from(lo[e]), f32::cast_from(hi[e]));
            let (cl, ch) = (f32::cast_from(c_lo[e]), f32::cast_from(c_hi[e]));
            let (sl, sh) = (f32::cast_from(s_lo[e]), f32::cast_from(s_hi[e]));
            if backward {
                out_lo[e] = F::cast_from(a * cl + z * sh);
                out_hi[e] = F::cast_from(z * ch - a * sl);
            } else {
                out_lo[e] = F::cast_from(a * cl - z * sl);
                out_hi[e] = F::cast_from(z * ch + a * sh);
            }
        }
        output[dst] = out_lo;
        output[dst + hv] = out_hi;
    }
}

#[allow(clippy::too_many_arguments)]
fn launch<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    input: &Handle,
    cos: &Handle,
    sin: &Handle,
    shape: RopeShape,
    output: &Handle,
    backward: bool,
) -> Result<(), KernelError> {
    let RopeShape {
        seq,
        heads,
        head_dim,
        ..
    } = shape;
    if shape.elems() == 0 || !head_dim.is_multiple_of(2) {
        return Err(shape_err(
            "rope",
            format!("shape {shape:?}: empty, or an odd head size"),
        ));
    }
    let e = std::mem::size_of::<F>();
    let tokens = shape.token_major()[0];
    check_buffer("rope", "input", input, shape.elems() * e)?;
    check_buffer("rope", "output", output, shape.elems() * e)?;
    check_buffer("rope", "cos", cos, tokens * head_dim * e)?;
    check_buffer("rope", "sin", sin, tokens * head_dim * e)?;
    let half = head_dim / 2;
    let vs = vector_width::<R, F>(client, half);
    let half_vecs = half / vs;
    let units = tokens * heads * half_vecs;
    let vectors = shape.elems() / vs;
    // SAFETY: sizes checked above; the kernel bounds its units, and every index it forms is
    // within `[tokens·heads·d]` (data) or `[tokens·d]` (tables) for a unit in bounds.
    unsafe {
        rope_kernel::launch_unchecked::<F, R>(
            client,
            grid_1d(units.div_ceil(CUBE as usize)),
            CubeDim::new_1d(CUBE),
            vs,
            ArrayArg::from_raw_parts(input.clone(), vectors),
            ArrayArg::from_raw_parts(cos.clone(), tokens * head_dim / vs),
            ArrayArg::from_raw_parts(sin.clone(), tokens * head_dim / vs),
            ArrayArg::from_raw_parts(output.clone(), vectors),
            seq as u32,
            heads as u32,
            half_vecs as u32,
            units as u32,
            backward,
        );
    }
    Ok(())
}

/// Forward: `x [batch·seq, heads·d]` -> `y [batch, heads, seq, d]` with the tables `cos`, `sin`
/// `[batch·seq, d]`, all of `F`.
pub fn forward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    x: &Handle,
    cos: &Handle,
    sin: &Handle,
    shape: RopeShape,
    y: &Handle,
) -> Result<(), KernelError> {
    launch::<R, F>(client, x, cos, sin, shape, y, false)
}

/// Backward: `dy [batch, heads, seq, d]` -> `dx [batch·seq, heads·d]` with the forward's tables.
pub fn backward<R: Runtime, F: Float>(
    client: &ComputeClient<R>,
    dy: &Handle,
    cos: &Handle,
    sin: &Handle,
    shape: RopeShape,
    dx: &Handle,
) -> Result<(), KernelError> {
    launch::<R, F>(client, dy, cos, sin, shape, dx, true)
}
