//! Activation checkpointing per decoder layer: the training forward keeps only each layer's
//! input, and the backward recomputes one layer at a time under a graph of its own.
//!
//! burn 0.21's autodiff cannot recompute a block inside its own backward pass: a custom op's
//! backward runs while the graph's lock is held, and a nested `backward()` takes every graph's
//! lock when it cleans up (a deadlock); its `BalancedCheckpointing` only recomputes element-wise
//! ops, so every matmul input and the attention scores stay alive. So the checkpointing is done
//! in two phases around the ordinary backward:
//!
//! 1. [`CausalLm::hidden_states_checkpointed`] runs the layers on the inner backend (no graph)
//!    and keeps each layer's input `[batch, seq, hidden]`; the last layer's output becomes a
//!    leaf that requires a gradient, and the final norm runs under autodiff on it.
//! 2. After `loss.backward()`, [`LayerCheckpoints::backward`] walks the layers from the last:
//!    it recomputes layer `i` under autodiff from its kept input (a fresh leaf), back-propagates
//!    the output gradient `g` through it (the gradient of `sum(y ⊙ g)`), moves the gradients of
//!    the layer's trainable parameters (LoRA A/B, trainable norms) into the caller's gradients
//!    and passes the input's gradient to layer `i - 1`.
//!
//! Peak activation memory: `layers x [batch, seq, hidden]` plus one layer's graph, instead of
//! every layer's graph (the MLP's `[batch, seq, intermediate]` tensors, the attention scores and
//! probabilities). The cost is one more forward of every layer.

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use qerl_nn::QerlBackend;

use crate::attention::{Masking, Step};
use crate::batch::TokenBatch;
use crate::error::Result;
use crate::model::CausalLm;

/// What the backward of a checkpointed forward needs: every layer's input and the inputs of
/// the attention (positions, key mask), to rebuild the layers' graphs one at a time.
pub struct LayerCheckpoints<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend> {
    /// Input of layer `i`, `[batch, seq, hidden]`, without a graph.
    inputs: Vec<Tensor<B::InnerBackend, 3>>,
    /// The last layer's output `[batch, seq, hidden]`: a leaf whose gradient starts phase 2.
    top: Tensor<B, 3>,
    /// `[batch * seq]`, the RoPE position of every token.
    positions: Vec<usize>,
    /// `[batch, seq]`: which tokens are real.
    key_mask: Vec<bool>,
    batch: usize,
    seq: usize,
    lora: bool,
}

impl<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend> CausalLm<B> {
    /// [`hidden_states`](Self::hidden_states) with per-layer activation checkpointing: the
    /// final hidden states `[batch, len, hidden]` (graph: the final norm only) and what
    /// [`LayerCheckpoints::backward`] needs to give the layers their gradients after
    /// `loss.backward()`. Without that call the layers get no gradients.
    pub fn hidden_states_checkpointed(
        &self,
        batch: &TokenBatch,
        lora: bool,
    ) -> Result<(Tensor<B, 3>, LayerCheckpoints<B>)> {
        self.check_ids(&batch.ids)?;
        let (b, s) = (batch.batch, batch.len);
        let positions = batch.positions();
        let step = inner_step(&self.step(&positions, &batch.mask, b, s, s, 0, lora));
        // The embeddings are frozen: their output carries no graph.
        let mut x = self.embed(&batch.ids, b, s).inner();
        let mut inputs = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            inputs.push(x.clone());
            x = layer.valid().forward(x, &step, None);
        }
        let top = Tensor::<B, 3>::from_inner(x).require_grad();
        let hidden = self.norm.forward(top.clone());
        let checkpoints = LayerCheckpoints {
            inputs,
            top,
            positions,
            key_mask: batch.mask.clone(),
            batch: b,
            seq: s,
            lora,
        };
        Ok((hidden, checkpoints))
    }
}

/// The step's tables on the inner backend (constants: no graph to drop).
fn inner_step<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend>(
    step: &Step<B>,
) -> Step<B::InnerBackend> {
    Step {
        cos: step.cos.clone().inner(),
        sin: step.sin.clone().inner(),
        masking: match &step.masking {
            Masking::Fused(ranges) => Masking::Fused(ranges.clone()),
            Masking::Bias(bias) => Masking::Bias(bias.clone().inner()),
        },
        offset: step.offset,
        lora: step.lora,
    }
}

impl<B: AutodiffBackend<InnerBackend: QerlBackend> + QerlBackend> LayerCheckpoints<B> {
    /// Phase 2: adds the gradients of every layer's trainable parameters to `grads` (the
    /// result of `loss.backward()` on a loss computed from the hidden states this forward
    /// returned). `model` is the model that ran the forward, unchanged.
    pub fn backward(self, model: &CausalLm<B>, grads: &mut B::Gradients) {
        let Some(mut g) = self.top.grad_remove(grads) else {
            return; // the loss does not depend on the layers
        };
        let step = model.step(
            &self.positions,
            &self.key_mask,
            self.batch,
            self.seq,
            self.seq,
            0,
            self.lora,
        );
        for (i, (layer, input)) in model.layers.iter().zip(self.inputs).enumerate().rev() {
            // Layer 0's input is the (frozen) embedding: no gradient to compute.
            let x = Tensor::<B, 3>::from_inner(input);
            let x = if i > 0 { x.require_grad() } else { x };
            let y = layer.forward(x.clone(), &step, None);
            let mut layer_grads = (y * Tensor::from_inner(g)).sum().backward();
            layer.visit(&mut MoveGrads {
                from: &mut layer_grads,
                to: grads,
            });
            match x.grad_remove(&mut layer_grads) {
                Some(dx) => g = dx,
                None => return, // layer 0 done
            }
        }
    }
}

/// Moves the gradient of each float parameter of a module from one set of gradients to
/// another (adding to a gradient already there).
struct MoveGrads<'a, B: AutodiffBackend> {
    from: &'a mut B::Gradients,
    to: &'a mut B::Gradients,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for MoveGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let Some(grad) = value.grad_remove(self.from) else {
            return;
        };
        let grad = match value.grad_remove(self.to) {
            Some(earlier) => earlier + grad,
            None => grad,
        };
        value.grad_replace(self.to, grad);
    }
}
