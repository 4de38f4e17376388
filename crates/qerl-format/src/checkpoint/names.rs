//! Which tensors of a decoder checkpoint are quantized linears, and which of them share an
//! NVFP4 global scale.
//!
//! A tensor is a quantized linear weight when its name is `<module>.weight` and the module's last
//! component is one of the seven decoder projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
//! `gate_proj`, `up_proj`, `down_proj`), e.g. `model.layers.3.self_attn.q_proj.weight`. Every
//! other tensor (embeddings, norms, biases, `lm_head`) is kept as it is.

/// The seven decoder projections qerl quantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearKind {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LinearKind {
    pub const ALL: [LinearKind; 7] = [
        LinearKind::Q,
        LinearKind::K,
        LinearKind::V,
        LinearKind::O,
        LinearKind::Gate,
        LinearKind::Up,
        LinearKind::Down,
    ];

    /// The module's last name component, e.g. `q_proj`.
    pub fn module_name(self) -> &'static str {
        match self {
            LinearKind::Q => "q_proj",
            LinearKind::K => "k_proj",
            LinearKind::V => "v_proj",
            LinearKind::O => "o_proj",
            LinearKind::Gate => "gate_proj",
            LinearKind::Up => "up_proj",
            LinearKind::Down => "down_proj",
        }
    }

    /// Short label for reports: `q`, `k`, `v`, `o`, `gate`, `up`, `down`.
    pub fn label(self) -> &'static str {
        match self {
            LinearKind::Q => "q",
            LinearKind::K => "k",
            LinearKind::V => "v",
            LinearKind::O => "o",
            LinearKind::Gate => "gate",
            LinearKind::Up => "up",
            LinearKind::Down => "down",
        }
    }

    fn from_module_name(name: &str) -> Option<Self> {
        LinearKind::ALL
            .into_iter()
            .find(|k| k.module_name() == name)
    }

    /// Suffix of the fused group this projection belongs to at inference (`qkv` or `gate_up`):
    /// vLLM runs q/k/v as one matrix and gate/up as one, so those share one NVFP4 global scale.
    pub fn fused_group(self) -> Option<&'static str> {
        match self {
            LinearKind::Q | LinearKind::K | LinearKind::V => Some("qkv"),
            LinearKind::Gate | LinearKind::Up => Some("gate_up"),
            LinearKind::O | LinearKind::Down => None,
        }
    }
}

impl std::fmt::Display for LinearKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// A tensor recognized as the weight of a quantized linear.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearName {
    /// Module name, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    pub kind: LinearKind,
}

impl LinearName {
    /// Key of the fused group (e.g. `model.layers.0.self_attn.qkv`), `None` for o/down.
    pub fn fused_key(&self) -> Option<String> {
        let group = self.kind.fused_group()?;
        let parent = self.module.rsplit_once('.').map_or("", |(p, _)| p);
        Some(if parent.is_empty() {
            group.to_string()
        } else {
            format!("{parent}.{group}")
        })
    }
}

/// Recognizes `<module>.weight` of one of the seven projections.
pub fn classify(tensor: &str) -> Option<LinearName> {
    let module = tensor.strip_suffix(".weight")?;
    let last = module.rsplit('.').next()?;
    let kind = LinearKind::from_module_name(last)?;
    Some(LinearName {
        module: module.to_string(),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_decoder_linears_only() {
        let q = classify("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.module, "model.layers.0.self_attn.q_proj");
        assert_eq!(q.kind, LinearKind::Q);
        assert_eq!(q.fused_key().unwrap(), "model.layers.0.self_attn.qkv");
        let up = classify("model.layers.11.mlp.up_proj.weight").unwrap();
        assert_eq!(up.fused_key().unwrap(), "model.layers.11.mlp.gate_up");
        let down = classify("model.layers.11.mlp.down_proj.weight").unwrap();
        assert_eq!(down.fused_key(), None);
        for kept in [
            "model.layers.0.self_attn.q_proj.bias",
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
        ] {
            assert_eq!(classify(kept), None, "{kept}");
        }
    }
}
