//! Each engine kernel against a host f64 reference on fresh random inputs (wgpu, f32), outputs
//! poisoned with NaN before the launch. Bound: relative error 1e-5 (f32 rounding of sums of a
//! few hundred terms).

use cubecl::prelude::*;
use cubecl::server::Handle;
use qerl_engine::kernels::act::{silu_mul, silu_mul_parts};
use qerl_engine::kernels::attention::{attention, AttentionScratch, AttentionShape};
use qerl_engine::kernels::dense::{dense, DenseEpilogue};
use qerl_engine::kernels::fused_lora::norm_lora;
use qerl_engine::kernels::norm::{add_rms_norm, Residual};
use qerl_engine::kernels::rope::{rope_kv, rope_kv_parts, rope_tables, RopeShape};
use qerl_engine::kernels::sample::{sample, SampleScratch, SlotState, Truncation};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R = cubecl::wgpu::WgpuRuntime;

fn client() -> ComputeClient<R> {
    R::client(&qerl_kernels::runtime::wgpu_device_or_exit())
}

fn rng() -> (StdRng, u64) {
    let seed: u64 = rand::rng().random();
    (StdRng::seed_from_u64(seed), seed)
}

fn uniform(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn up(c: &ComputeClient<R>, v: &[f32]) -> Handle {
    c.create_from_slice(f32::as_bytes(v))
}

fn up_u32(c: &ComputeClient<R>, v: &[u32]) -> Handle {
    c.create_from_slice(u32::as_bytes(v))
}

fn nan(c: &ComputeClient<R>, len: usize) -> Handle {
    up(c, &vec![f32::NAN; len])
}

fn read(c: &ComputeClient<R>, h: &Handle) -> Vec<f32> {
    f32::from_bytes(&c.read_one(h.clone()).unwrap()).to_vec()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    assert!(
        got.iter().all(|g| g.is_finite()),
        "{what}: unwritten element, seed {seed}"
    );
    let rel = (num / den).sqrt();
    assert!(rel < 1e-5, "{what}: relative error {rel:.2e}, seed {seed}");
}

#[test]
fn dense_products_with_segments_bias_and_lora() {
    let c = client();
    let (mut g, seed) = rng();
    for (m, n, k, segments) in [
        (1, 24, 64, 1),
        (3, 16, 96, 3),
        (8, 40, 32, 2),
        (19, 33, 64, 1),
        (2, 520, 96, 1),
        (5, 300, 64, 2),
    ] {
        let x = uniform(&mut g, m * k);
        let ws: Vec<Vec<f32>> = (0..segments).map(|_| uniform(&mut g, n * k)).collect();
        let bias = uniform(&mut g, n);
        let rank = 3;
        let t = uniform(&mut g, m * rank);
        let b = uniform(&mut g, n * rank);
        let epi = segments == 1;
        let xh = up(&c, &x);
        let wh: Vec<Handle> = ws.iter().map(|w| up(&c, w)).collect();
        let ys: Vec<Handle> = (0..segments).map(|_| nan(&c, m * n)).collect();
        let (bh, th, bbh) = (up(&c, &bias), up(&c, &t), up(&c, &b));
        let epilogue = if epi {
            DenseEpilogue {
                bias: Some(&bh),
                lora: Some((&th, &bbh, rank, 0.7)),
            }
        } else {
            DenseEpilogue::default()
        };
        let wr: Vec<&Handle> = wh.iter().collect();
        let yr: Vec<&Handle> = ys.iter().collect();
        dense::<R, f32, f32>(&c, &xh, m, &wr, n, k, epilogue, &yr);
        for (s, w) in ws.iter().enumerate() {
            let want: Vec<f64> = (0..m * n)
                .map(|i| {
                    let (r, o) = (i / n, i % n);
                    let mut v: f64 = (0..k)
                        .map(|j| x[r * k + j] as f64 * w[o * k + j] as f64)
                        .sum();
                    if epi {
                        v += bias[o] as f64;
                        v += 0.7
                            * (0..rank)
                                .map(|j| t[r * rank + j] as f64 * b[o * rank + j] as f64)
                                .sum::<f64>();
                    }
                    v
                })
                .collect();
            assert_close(
                &format!("dense m{m} n{n} k{k} segment {s}"),
                &read(&c, &ys[s]),
                &want,
                seed,
            );
        }
    }
}

#[test]
fn silu_mul_over_whole_and_partial_vectors() {
    let c = client();
    let (mut g, seed) = rng();
    // Vectors of 4, 2 and 1 f32 (the lengths 4·96, 2·3, 7).
    for len in [384, 6, 7] {
        let gate = uniform(&mut g, len);
        let upv = uniform(&mut g, len);
        let out = nan(&c, len);
        silu_mul::<R, f32>(&c, &up(&c, &gate), &up(&c, &upv), &out, len);
        let want: Vec<f64> = gate
            .iter()
            .zip(&upv)
            .map(|(&a, &b)| a as f64 / (1.0 + (-(a as f64)).exp()) * b as f64)
            .collect();
        assert_close(&format!("silu_mul {len}"), &read(&c, &out), &want, seed);
    }
}

/// RoPE's `(cos, sin)` tables for heads of `hd` channels and `cap` positions (base 10,000).
fn tables(hd: usize, cap: usize) -> (Vec<f32>, Vec<f32>) {
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / hd as f32))
        .collect();
    rope_tables(&inv_freq, cap)
}

/// SiLU·mul from a split gate/up product's K-slices equals SiLU·mul of the slices summed in
/// slice order, bit for bit (the reduction it replaces sums them so), at 1, 2 and 5 slices.
#[test]
fn silu_mul_from_split_slices_equals_the_reduced_form() {
    let c = client();
    let (mut g, seed) = rng();
    for (splits, rows, width) in [(1, 3, 8), (2, 5, 36), (5, 2, 4)] {
        // [splits, rows, 2·width]: gate in the first `width` columns of a row, up after.
        let parts = uniform(&mut g, splits * rows * 2 * width);
        let sum = |r: usize, col: usize| {
            (0..splits).fold(0.0f32, |a, s| a + parts[(s * rows + r) * 2 * width + col])
        };
        let gate: Vec<f32> = (0..rows * width)
            .map(|i| sum(i / width, i % width))
            .collect();
        let upv: Vec<f32> = (0..rows * width)
            .map(|i| sum(i / width, width + i % width))
            .collect();
        let want = nan(&c, rows * width);
        silu_mul::<R, f32>(&c, &up(&c, &gate), &up(&c, &upv), &want, rows * width);
        let out = nan(&c, rows * width);
        silu_mul_parts::<R, f32>(&c, &up(&c, &parts), splits, rows, width, &out);
        let (got, want) = (read(&c, &out), read(&c, &want));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "silu_mul_parts splits={splits} rows={rows} width={width}: element {i} is {a}, \
                 the reduced form {b} (seed {seed})"
            );
        }
    }
}

#[test]
fn residual_add_and_rms_norm_with_gather() {
    // One vector a unit or less (96, 1000), two-element vectors (90), several vectors a unit
    // (3584 f32: 896 vectors over 256 units).
    for dim in [96, 90, 1000, 3584] {
        add_rms_norm_case(dim);
    }
}

fn add_rms_norm_case(dim: usize) {
    let c = client();
    let (mut g, seed) = rng();
    let rows = 5;
    let h = uniform(&mut g, rows * dim);
    let d = uniform(&mut g, rows * dim);
    let gain = uniform(&mut g, dim);
    let (hh, dh, gh) = (up(&c, &h), up(&c, &d), up(&c, &gain));
    let index = [4u32, 1];
    let ih = up_u32(&c, &index);
    let y = nan(&c, 2 * dim);
    add_rms_norm::<R, f32>(
        &c,
        &hh,
        rows,
        Residual::Dense(&dh),
        &gh,
        Some(&ih),
        2,
        dim,
        1e-6,
        &y,
    );
    let mut want = Vec::new();
    for &s in &index {
        let x: Vec<f64> = (0..dim)
            .map(|i| (h[s as usize * dim + i] + d[s as usize * dim + i]) as f64)
            .collect();
        let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        want.extend(x.iter().zip(&gain).map(|(v, &w)| v * r * w as f64));
    }
    assert_close("add_rms_norm gathered", &read(&c, &y), &want, seed);
    // Gathering leaves the residual as it was (a row may be gathered twice); without a gather
    // every row's residual is updated in place.
    assert_eq!(read(&c, &hh), h);
    let y = nan(&c, rows * dim);
    add_rms_norm::<R, f32>(
        &c,
        &hh,
        rows,
        Residual::Dense(&dh),
        &gh,
        None,
        rows,
        dim,
        1e-6,
        &y,
    );
    let sum: Vec<f32> = h.iter().zip(&d).map(|(a, b)| a + b).collect();
    assert_eq!(read(&c, &hh), sum);
}

/// `T [rows, rank] = x · aᵀ` on the host in f64.
fn lora_t(x: &[f32], a: &[f32], rows: usize, rank: usize, k: usize) -> Vec<f64> {
    (0..rows * rank)
        .map(|i| {
            let (r, j) = (i / rank, i % rank);
            (0..k)
                .map(|c| x[r * k + c] as f64 * a[j * k + c] as f64)
                .sum()
        })
        .collect()
}

#[test]
fn norm_with_fused_lora_equals_the_norm_then_the_down_projections() {
    let c = client();
    let (mut g, seed) = rng();
    // Widths of one vector a unit or less, two-element vectors, several vectors a unit; the
    // residual: none, a product's output, or its unreduced K-slices (2 and 3).
    for (rows, dim, adapters, rank, slices) in [
        (1, 96, 3, 4, None),
        (5, 90, 2, 4, Some(0)),
        (8, 1000, 1, 6, Some(2)),
        (2, 3584, 3, 16, Some(3)),
    ] {
        let h = uniform(&mut g, rows * dim);
        let gain = uniform(&mut g, dim);
        let a: Vec<Vec<f32>> = (0..adapters).map(|_| uniform(&mut g, rank * dim)).collect();
        // d: the dense output, or the slices and what their reduction would store.
        let parts = uniform(&mut g, slices.unwrap_or(0).max(1) * rows * dim);
        let d: Vec<f32> = match slices {
            Some(n) if n > 0 => (0..rows * dim)
                .map(|i| (0..n).fold(0.0f32, |acc, s| acc + parts[s * rows * dim + i]))
                .collect(),
            _ => parts[..rows * dim].to_vec(),
        };
        let (hh, dh, ph, gh) = (up(&c, &h), up(&c, &d), up(&c, &parts), up(&c, &gain));
        let residual = match slices {
            None => Residual::None,
            Some(0) => Residual::Dense(&dh),
            Some(n) => Residual::Parts(&ph, n),
        };
        let ah: Vec<Handle> = a.iter().map(|v| up(&c, v)).collect();
        let th: Vec<Handle> = (0..adapters).map(|_| nan(&c, rows * rank)).collect();
        let (h_out, y) = (nan(&c, rows * dim), nan(&c, rows * dim));
        let ran = norm_lora::<R, f32>(
            &c,
            &hh,
            residual,
            &h_out,
            &gh,
            rows,
            dim,
            1e-6,
            &y,
            &ah.iter().collect::<Vec<_>>(),
            rank,
            &th.iter().collect::<Vec<_>>(),
        );
        assert!(ran, "norm_lora applies to {rows} rows");
        // The norm is the unfused kernel's with the dense residual, bit for bit (the slices
        // added in the reduction's order); `h` is left as it was.
        let want_y = nan(&c, rows * dim);
        let h_copy = up(&c, &h);
        let dense = if slices.is_some() {
            Residual::Dense(&dh)
        } else {
            Residual::None
        };
        add_rms_norm::<R, f32>(
            &c, &h_copy, rows, dense, &gh, None, rows, dim, 1e-6, &want_y,
        );
        let what = format!("norm_lora rows {rows} dim {dim} adapters {adapters} slices {slices:?}");
        let yv = read(&c, &y);
        assert_eq!(yv, read(&c, &want_y), "{what}: norm output, seed {seed}");
        assert_eq!(read(&c, &hh), h, "{what}: h untouched, seed {seed}");
        if slices.is_some() {
            assert_eq!(
                read(&c, &h_out),
                read(&c, &h_copy),
                "{what}: residual, seed {seed}"
            );
            // The unfused norm reads the slices the same way.
            if let Some(n @ 1..) = slices {
                let (h_parts, y_parts) = (up(&c, &h), nan(&c, rows * dim));
                let r = Residual::Parts(&ph, n);
                add_rms_norm::<R, f32>(&c, &h_parts, rows, r, &gh, None, rows, dim, 1e-6, &y_parts);
                assert_eq!(
                    read(&c, &y_parts),
                    yv,
                    "{what}: unfused, slices, seed {seed}"
                );
                assert_eq!(read(&c, &h_parts), read(&c, &h_copy), "{what}: seed {seed}");
            }
        }
        for (s, (av, t)) in a.iter().zip(&th).enumerate() {
            let want = lora_t(&yv, av, rows, rank, dim);
            assert_close(&format!("{what}: T_{s}"), &read(&c, t), &want, seed);
        }
    }
}

/// RoPE from a split q/k/v product's K-slices (`rope_kv_parts`) equals `rope_kv` of the slices
/// summed in order with the biases added (the reduction it replaces), bit for bit: the rotated
/// queries and the whole caches, with and without biases, at 1 and 3 slices.
#[test]
fn rope_kv_from_split_slices_equals_the_reduced_form() {
    let c = client();
    let (mut g, seed) = rng();
    let (q_heads, kv_heads, hd, slots, cap) = (4, 2, 16, 3, 40);
    let (cos, sin) = tables(hd, cap);
    let (ch, sh) = (up(&c, &cos), up(&c, &sin));
    let rows = [(2u32, 39u32), (0, 0), (1, 7), (0, 5)];
    let slot: Vec<u32> = rows.iter().map(|r| r.0).collect();
    let pos: Vec<u32> = rows.iter().map(|r| r.1).collect();
    let (slh, ph) = (up_u32(&c, &slot), up_u32(&c, &pos));
    let m = rows.len();
    let (q_dim, kv_dim) = (q_heads * hd, kv_heads * hd);
    let total = q_dim + 2 * kv_dim;
    let rs = RopeShape {
        rows: m,
        q_heads,
        kv_heads,
        head_dim: hd,
        capacity: cap,
        slots,
        max_positions: cap,
    };
    let kv_len = slots * kv_heads * cap * hd;
    for (splits, with_bias) in [(1, false), (3, true), (3, false)] {
        let parts = uniform(&mut g, splits * m * total);
        let bias = uniform(&mut g, total);
        // The reduced columns: slices in order from 0, then the bias.
        let col = |r: usize, j: usize| {
            let s = (0..splits).fold(0.0f32, |a, z| a + parts[(z * m + r) * total + j]);
            if with_bias {
                s + bias[j]
            } else {
                s
            }
        };
        let cols = |lo: usize, n: usize| -> Vec<f32> {
            (0..m * n).map(|i| col(i / n, lo + i % n)).collect()
        };
        let (q, k, v) = (
            cols(0, q_dim),
            cols(q_dim, kv_dim),
            cols(q_dim + kv_dim, kv_dim),
        );
        let cache0 = uniform(&mut g, kv_len);
        let (want_q, want_k, want_v) = (up(&c, &q), up(&c, &cache0), up(&c, &cache0));
        rope_kv::<R, f32>(
            &c,
            rs,
            &want_q,
            &up(&c, &k),
            &up(&c, &v),
            &slh,
            &ph,
            &ch,
            &sh,
            &want_k,
            &want_v,
        );
        let (got_q, got_k, got_v) = (nan(&c, m * q_dim), up(&c, &cache0), up(&c, &cache0));
        let bh = [
            up(&c, &bias[..q_dim]),
            up(&c, &bias[q_dim..q_dim + kv_dim]),
            up(&c, &bias[q_dim + kv_dim..]),
        ];
        let biases = with_bias.then(|| [&bh[0], &bh[1], &bh[2]]);
        let ph_parts = up(&c, &parts);
        rope_kv_parts::<R, f32>(
            &c,
            rs,
            (&ph_parts, splits),
            biases,
            &got_q,
            &slh,
            &ph,
            &ch,
            &sh,
            &got_k,
            &got_v,
        );
        for (what, got, want) in [
            ("q", &got_q, &want_q),
            ("k cache", &got_k, &want_k),
            ("v cache", &got_v, &want_v),
        ] {
            let (got, want) = (read(&c, got), read(&c, want));
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "rope_kv_parts splits={splits} bias={with_bias}: {what} element {bad:?} differs \
                 from the reduced form (seed {seed})"
            );
        }
    }
}

#[test]
fn rope_kv_write_then_grouped_attention_over_the_cache() {
    // Small heads; a group of four at 64 channels; Qwen2.5-7B's group of seven at 128.
    for (q_heads, kv_heads, hd) in [(6, 2, 16), (8, 2, 64), (14, 2, 128)] {
        rope_then_attention(q_heads, kv_heads, hd);
    }
}

fn rope_then_attention(q_heads: usize, kv_heads: usize, hd: usize) {
    let c = client();
    let (mut g, seed) = rng();
    let (slots, cap) = (3, 150);
    let (cos, sin) = tables(hd, cap);
    let (ch, sh) = (up(&c, &cos), up(&c, &sin));
    let kv_len = slots * kv_heads * cap * hd;
    let kc = uniform(&mut g, kv_len);
    let vc = uniform(&mut g, kv_len);
    let (kch, vch) = (up(&c, &kc), up(&c, &vc));
    // Three rows: slot 2 at position 140 (two tiles of context), slot 0 at 0, slot 1 at 7.
    let rows = [(2u32, 140u32), (0, 0), (1, 7)];
    let slot: Vec<u32> = rows.iter().map(|r| r.0).collect();
    let pos: Vec<u32> = rows.iter().map(|r| r.1).collect();
    let (slh, ph) = (up_u32(&c, &slot), up_u32(&c, &pos));
    let m = rows.len();
    let q = uniform(&mut g, m * q_heads * hd);
    let k = uniform(&mut g, m * kv_heads * hd);
    let v = uniform(&mut g, m * kv_heads * hd);
    let (qh, kh, vh) = (up(&c, &q), up(&c, &k), up(&c, &v));
    let rs = RopeShape {
        rows: m,
        q_heads,
        kv_heads,
        head_dim: hd,
        capacity: cap,
        slots,
        max_positions: cap,
    };
    rope_kv::<R, f32>(&c, rs, &qh, &kh, &vh, &slh, &ph, &ch, &sh, &kch, &vch);
    // Unsplit, split in two and three spans (the last one past some rows' context), the plan;
    // spans over the whole capacity and over the longest row's context only (141 positions).
    let scratch = AttentionScratch::new(&c, q_heads, kv_heads, hd, 12);
    let outs: Vec<(Option<usize>, Handle)> = [cap, 141]
        .into_iter()
        .flat_map(|context| [Some(1), Some(2), Some(3), None].map(|s| (context, s)))
        .map(|(context, splits)| {
            let ash = AttentionShape {
                rows: m,
                q_heads,
                kv_heads,
                head_dim: hd,
                capacity: cap,
                slots,
                context,
            };
            let out = nan(&c, m * q_heads * hd);
            attention::<R, f32>(&c, ash, &qh, &kch, &vch, &slh, &ph, &out, &scratch, splits);
            (splits, out)
        })
        .collect();

    // Host: rotate, write, attend.
    let rot = |x: &[f32], p: usize| -> Vec<f64> {
        let half = hd / 2;
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for i in 0..half {
            let (cs, sn) = (cos[p * half + i] as f64, sin[p * half + i] as f64);
            y[i] = x[i] as f64 * cs - x[i + half] as f64 * sn;
            y[i + half] = x[i + half] as f64 * cs + x[i] as f64 * sn;
        }
        y
    };
    let mut kh_host: Vec<f64> = kc.iter().map(|&v| v as f64).collect();
    let mut vh_host: Vec<f64> = vc.iter().map(|&v| v as f64).collect();
    for (r, &(s, p)) in rows.iter().enumerate() {
        for h in 0..kv_heads {
            let dst = ((s as usize * kv_heads + h) * cap + p as usize) * hd;
            let kr = rot(
                &k[(r * kv_heads + h) * hd..(r * kv_heads + h + 1) * hd],
                p as usize,
            );
            kh_host[dst..dst + hd].copy_from_slice(&kr);
            for i in 0..hd {
                vh_host[dst + i] = v[(r * kv_heads + h) * hd + i] as f64;
            }
        }
    }
    let mut want = Vec::new();
    for (r, &(s, p)) in rows.iter().enumerate() {
        for h in 0..q_heads {
            let kvh = h / (q_heads / kv_heads);
            let qr = rot(
                &q[(r * q_heads + h) * hd..(r * q_heads + h + 1) * hd],
                p as usize,
            );
            let base = (s as usize * kv_heads + kvh) * cap * hd;
            let sc: Vec<f64> = (0..=p as usize)
                .map(|j| {
                    (0..hd)
                        .map(|i| qr[i] * kh_host[base + j * hd + i])
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..hd {
                want.push(
                    (0..=p as usize)
                        .map(|j| e[j] / z * vh_host[base + j * hd + i])
                        .sum::<f64>(),
                );
            }
        }
    }
    for (splits, out) in &outs {
        assert_close(
            &format!("attention, splits {splits:?}"),
            &read(&c, out),
            &want,
            seed,
        );
    }
    let kc2 = read(&c, &kch);
    assert_close("k cache", &kc2, &kh_host, seed);
}

/// The device's counter-based random bits, on the host (murmur3's finalizer chained).
fn hash4(seed: u32, a: u32, b: u32, c: u32, d: u32) -> u32 {
    let mix = |x: u32| {
        let mut h = x;
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    };
    let mut h = mix(seed ^ 0x9e37_79b9);
    h = mix(h ^ a);
    h = mix(h ^ b.wrapping_mul(0x27d4_eb2f));
    h = mix(h ^ c.wrapping_mul(0x1656_67b1));
    mix(h ^ d.wrapping_mul(0x9e37_79b1))
}

#[test]
fn sampling_over_vocabulary_chunks_matches_the_host() {
    let c = client();
    let (mut g, seed) = rng();
    // Five chunks of the vocabulary, the last one partial; rows map to slots out of order.
    let (vocab, slots) = (10_000usize, 4usize);
    let slot_of = [2u32, 0, 3];
    let rows = slot_of.len();
    let none = Truncation::default();
    let top_k = Truncation {
        top_k: 40,
        top_p: 1.0,
    };
    let top_p = Truncation {
        top_k: 0,
        top_p: 0.9,
    };
    let both = Truncation {
        top_k: 300,
        top_p: 0.5,
    };
    for (temperature, trunc) in [
        (0.0f32, none),
        (0.7, none),
        (0.7, top_k),
        (1.3, top_p),
        (0.9, both),
        (0.0, both),
    ] {
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|_| g.random_range(-4.0f32..4.0))
            .collect();
        let generated: Vec<u32> = (0..slots as u32).map(|i| 3 + i).collect();
        let rng_id: Vec<u32> = (0..slots as u32).map(|i| 100 + 7 * i).collect();
        let request: Vec<u32> = (0..slots as u32).collect();
        let cap_new = 16;
        let state = SlotState {
            tokens: up_u32(&c, &vec![0; slots]),
            pos: up_u32(&c, &vec![5; slots]),
            generated: up_u32(&c, &generated),
            done: up_u32(&c, &vec![0; slots]),
            request: up_u32(&c, &request),
            rng_id: up_u32(&c, &rng_id),
            max_new: up_u32(&c, &vec![cap_new as u32; slots]),
            out_tokens: up_u32(&c, &vec![u32::MAX; slots * cap_new]),
            out_logprob: nan(&c, slots * cap_new),
            slots,
            requests: slots,
            capacity_new: cap_new,
        };
        let scratch = SampleScratch::new(&c, rows, vocab);
        let sample_seed = 1234u32;
        sample(
            &c,
            &up(&c, &logits),
            rows,
            vocab,
            &up_u32(&c, &slot_of),
            &up_u32(&c, &[u32::MAX]),
            0,
            &state,
            temperature,
            sample_seed,
            trunc,
            &scratch,
        );
        let tokens = u32::from_bytes(&c.read_one(state.out_tokens.clone()).unwrap()).to_vec();
        let logprob = read(&c, &state.out_logprob);
        let inv_t = if temperature > 0.0 {
            1.0 / temperature as f64
        } else {
            1.0
        };
        for (i, &slot) in slot_of.iter().enumerate() {
            let slot = slot as usize;
            let x: Vec<f64> = logits[i * vocab..(i + 1) * vocab]
                .iter()
                .map(|&l| l as f64 * inv_t)
                .collect();
            let key = |v: usize| {
                if temperature == 0.0 {
                    return x[v];
                }
                let h = hash4(sample_seed, rng_id[slot], generated[slot], v as u32, 7);
                let u = ((h >> 8) as f64 + 0.5) / 16_777_216.0;
                x[v] - (-u.ln()).ln()
            };
            // transformers' warpers: top-k (ties kept), then top-p over the renormalised rest
            // (a token is kept when the strictly more likely ones hold less than p).
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
            let mut kept = vec![temperature == 0.0; vocab];
            if temperature > 0.0 {
                let kth = if trunc.top_k > 0 {
                    x[order[trunc.top_k - 1]]
                } else {
                    f64::MIN
                };
                let in_k: Vec<usize> = order.iter().copied().filter(|&v| x[v] >= kth).collect();
                let z: f64 = in_k.iter().map(|&v| (x[v] - x[order[0]]).exp()).sum();
                // In decreasing order: the mass strictly above a group of equal values.
                let mut above = 0.0f64;
                let mut g = 0;
                while g < in_k.len() {
                    let mut end = g;
                    let mut group = 0.0;
                    while end < in_k.len() && x[in_k[end]] == x[in_k[g]] {
                        group += (x[in_k[end]] - x[order[0]]).exp();
                        end += 1;
                    }
                    for &v in &in_k[g..end] {
                        kept[v] = above / z < trunc.top_p as f64;
                    }
                    above += group;
                    g = end;
                }
            }
            let want = (0..vocab)
                .filter(|&v| kept[v])
                .max_by(|&a, &b| key(a).total_cmp(&key(b)).then(b.cmp(&a)))
                .unwrap();
            let mx = x.iter().cloned().fold(f64::MIN, f64::max);
            let lse = mx + x.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            let at = slot * cap_new + generated[slot] as usize;
            assert_eq!(
                tokens[at] as usize, want,
                "T {temperature} {trunc:?}, row {i}: token, seed {seed}"
            );
            let lp = x[want] - lse;
            assert!(
                (logprob[at] as f64 - lp).abs() < 1e-4 * (1.0 + lp.abs()),
                "T {temperature}, row {i}: log-prob {} vs {lp}, seed {seed}",
                logprob[at]
            );
        }
    }
}
