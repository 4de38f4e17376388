//! Host-side batches of token sequences of different lengths.
//!
//! Sequences are padded to one length (on the left for generation, so that every sequence's
//! next token is at the same column; either side for scoring). Padding is excluded by the
//! attention mask, and each token's RoPE position counts only the real tokens before it
//! (`cumsum(mask) - 1`, as transformers computes `position_ids` from the attention mask), so a
//! padded sequence gives the same logits as the same sequence alone.

use crate::error::{ModelError, Result};

/// Which side padding goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Padding {
    Left,
    Right,
}

/// `batch` sequences padded to `len` tokens: row-major `[batch, len]` ids and mask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    pub batch: usize,
    pub len: usize,
    /// Token ids, padding filled with the pad id.
    pub ids: Vec<u32>,
    /// `true` for a real token, `false` for padding.
    pub mask: Vec<bool>,
}

impl TokenBatch {
    /// Pads `seqs` (each non-empty) with `pad_id` on the given side.
    pub fn new(seqs: &[Vec<u32>], pad_id: u32, side: Padding) -> Result<Self> {
        if seqs.is_empty() {
            return Err(ModelError::Input("empty batch: no sequences".into()));
        }
        if let Some(i) = seqs.iter().position(Vec::is_empty) {
            return Err(ModelError::Input(format!(
                "sequence {i} of the batch is empty"
            )));
        }
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(seqs.len() * len);
        let mut mask = Vec::with_capacity(seqs.len() * len);
        for seq in seqs {
            let pad = len - seq.len();
            let pads = std::iter::repeat_n(pad_id, pad);
            let masks = std::iter::repeat_n(false, pad);
            match side {
                Padding::Left => {
                    ids.extend(pads.chain(seq.iter().copied()));
                    mask.extend(masks.chain(std::iter::repeat_n(true, seq.len())));
                }
                Padding::Right => {
                    ids.extend(seq.iter().copied().chain(pads));
                    mask.extend(std::iter::repeat_n(true, seq.len()).chain(masks));
                }
            }
        }
        Ok(TokenBatch {
            batch: seqs.len(),
            len,
            ids,
            mask,
        })
    }

    /// Like [`new`](Self::new) with the length rounded up to a multiple of `multiple` (more
    /// padding; fewer distinct shapes for the kernels' autotuner and compiler).
    pub fn padded_to_multiple(
        seqs: &[Vec<u32>],
        pad_id: u32,
        side: Padding,
        multiple: usize,
    ) -> Result<Self> {
        let mut b = Self::new(seqs, pad_id, side)?;
        let len = b.len.div_ceil(multiple.max(1)) * multiple.max(1);
        if len > b.len {
            let extra = len - b.len;
            let (mut ids, mut mask) = (
                Vec::with_capacity(b.batch * len),
                Vec::with_capacity(b.batch * len),
            );
            for (row_ids, row_mask) in b.ids.chunks_exact(b.len).zip(b.mask.chunks_exact(b.len)) {
                let (pi, pm) = (
                    std::iter::repeat_n(pad_id, extra),
                    std::iter::repeat_n(false, extra),
                );
                match side {
                    Padding::Left => {
                        ids.extend(pi.chain(row_ids.iter().copied()));
                        mask.extend(pm.chain(row_mask.iter().copied()));
                    }
                    Padding::Right => {
                        ids.extend(row_ids.iter().copied().chain(pi));
                        mask.extend(row_mask.iter().copied().chain(pm));
                    }
                }
            }
            b = TokenBatch {
                batch: b.batch,
                len,
                ids,
                mask,
            };
        }
        Ok(b)
    }

    /// One unpadded sequence.
    pub fn single(seq: &[u32]) -> Result<Self> {
        Self::new(&[seq.to_vec()], 0, Padding::Right)
    }

    /// RoPE positions `[batch, len]`: the number of real tokens before each token (padding
    /// gets the count so far; its outputs are never used).
    pub fn positions(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.ids.len());
        for row in self.mask.chunks_exact(self.len) {
            let mut seen = 0usize;
            for &m in row {
                out.push(seen);
                seen += usize::from(m);
            }
        }
        out
    }

    /// Number of real tokens of each sequence.
    pub fn lengths(&self) -> Vec<usize> {
        self.mask
            .chunks_exact(self.len)
            .map(|r| r.iter().filter(|&&m| m).count())
            .collect()
    }
}

/// The additive attention bias `[batch, q_len, k_len]` (row-major, f32): 0 where query `i`
/// (absolute column `offset + i`) may attend key `j`, [`MASKED`] elsewhere. A key is visible
/// if it is a real token (`key_mask`, `[batch, k_len]`) and not in the future (`j <= offset + i`).
pub fn attention_bias(
    key_mask: &[bool],
    batch: usize,
    q_len: usize,
    k_len: usize,
    offset: usize,
) -> Vec<f32> {
    assert_eq!(key_mask.len(), batch * k_len);
    assert!(offset + q_len <= k_len, "queries beyond the keys");
    let mut bias = vec![MASKED; batch * q_len * k_len];
    for b in 0..batch {
        for i in 0..q_len {
            let row = &mut bias[(b * q_len + i) * k_len..][..k_len];
            for (j, v) in row.iter_mut().enumerate().take(offset + i + 1) {
                if key_mask[b * k_len + j] {
                    *v = 0.0;
                }
            }
        }
    }
    bias
}

/// The bias of a masked attention entry. Finite, so that a row with no visible key (a padding
/// query) gives a uniform softmax instead of NaN; far below any real score.
pub const MASKED: f32 = -1.0e30;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_padding_positions_and_bias() {
        let b = TokenBatch::new(&[vec![5, 6, 7], vec![8]], 0, Padding::Left).unwrap();
        assert_eq!(b.ids, vec![5, 6, 7, 0, 0, 8]);
        assert_eq!(b.mask, vec![true, true, true, false, false, true]);
        assert_eq!(b.positions(), vec![0, 1, 2, 0, 0, 0]);
        assert_eq!(b.lengths(), vec![3, 1]);
        let bias = attention_bias(&b.mask, 2, 3, 3, 0);
        let m = MASKED;
        assert_eq!(&bias[..9], &[0.0, m, m, 0.0, 0.0, m, 0.0, 0.0, 0.0]);
        assert_eq!(&bias[9..], &[m, m, m, m, m, m, m, m, 0.0]);
        // one decode step with a 3-token history plus the new token
        let mask = [true, true, true, true, false, false, true, true];
        assert_eq!(
            attention_bias(&mask, 2, 1, 4, 3),
            vec![0.0, 0.0, 0.0, 0.0, m, m, 0.0, 0.0]
        );
    }

    #[test]
    fn right_padding_and_errors() {
        let b = TokenBatch::new(&[vec![1], vec![2, 3]], 9, Padding::Right).unwrap();
        assert_eq!(b.ids, vec![1, 9, 2, 3]);
        assert_eq!(b.positions(), vec![0, 1, 0, 1]);
        assert!(TokenBatch::new(&[], 0, Padding::Left).is_err());
        let p = TokenBatch::padded_to_multiple(&[vec![1, 2, 3]], 0, Padding::Left, 4).unwrap();
        assert_eq!(
            (p.len, p.ids.clone(), p.positions()),
            (4, vec![0, 1, 2, 3], vec![0, 0, 1, 2])
        );
        assert!(TokenBatch::new(&[vec![1], vec![]], 0, Padding::Left).is_err());
    }
}
