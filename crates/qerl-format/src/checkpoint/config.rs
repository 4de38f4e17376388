//! The `quantization_config` qerl adds to `config.json`, and the text of the written file.
//!
//! * NVFP4 / MXFP4: what compressed-tensors' `ModelCompressor.update_config` writes after
//!   llm-compressor's `NVFP4A16` / `MXFP4A16` schemes (one config group targeting `Linear`,
//!   `lm_head` ignored); the file is `json.dump(config, indent=2, sort_keys=True)` (no newline).
//! * NF4: transformers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
//!   bnb_4bit_compute_dtype=<weight dtype>).to_dict()`; the file is `json.dumps(config,
//!   indent=2, sort_keys=True) + "\n"` as `PretrainedConfig.to_json_file` writes it.

use serde_json::{json, Map, Value};

use super::pyjson;
use crate::{QuantFormat, SourceDtype};

/// compressed-tensors release whose `config.json` layout qerl reproduces (its `version` key).
/// See tools/compressed_tensors_nvfp4.md.
pub const COMPRESSED_TENSORS_VERSION: &str = "0.20.0";

/// The weight arguments of the single config group, as compressed-tensors 0.20's
/// `QuantizationArgs` serializer writes them after llm-compressor set the observer (`None`
/// fields, `zp_dtype` of a symmetric scheme and empty `observer_kwargs` are left out).
fn weight_args(format: QuantFormat) -> Value {
    let (strategy, group_size, scale_dtype) = match format {
        QuantFormat::Nvfp4 => ("tensor_group", 16, "torch.float8_e4m3fn"),
        _ => ("group", 32, "torch.uint8"),
    };
    json!({
        "num_bits": 4,
        "type": "float",
        "symmetric": true,
        "group_size": group_size,
        "strategy": strategy,
        "dynamic": false,
        "scale_dtype": scale_dtype,
        "observer": "memoryless_minmax",
    })
}

/// `ModelCompressor.update_config`: version, method, empty sparsity and transform configs,
/// then `QuantizationConfig.model_dump(exclude=["quant_method"])`.
fn compressed_tensors_config(format: QuantFormat) -> Value {
    let ct_format = match format {
        QuantFormat::Nvfp4 => "nvfp4-pack-quantized",
        _ => "mxfp4-pack-quantized",
    };
    json!({
        "version": COMPRESSED_TENSORS_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weight_args(format),
                "input_activations": null,
                "output_activations": null,
                "format": ct_format,
            }
        },
        "kv_cache_scheme": null,
        "format": ct_format,
        "quantization_status": "compressed",
        "global_compression_ratio": null,
        "ignore": ["lm_head"],
        "moe_sparsity_config": null,
    })
}

/// `str(torch.<dtype>).split(".")[1]` for the weight dtype.
fn torch_dtype_name(dtype: SourceDtype) -> &'static str {
    match dtype {
        SourceDtype::BF16 => "bfloat16",
        SourceDtype::F16 => "float16",
        SourceDtype::F32 => "float32",
    }
}

fn bitsandbytes_config(compute_dtype: SourceDtype) -> Value {
    json!({
        "quant_method": "bitsandbytes",
        "_load_in_8bit": false,
        "_load_in_4bit": true,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": null,
        "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": false,
        "bnb_4bit_compute_dtype": torch_dtype_name(compute_dtype),
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": true,
        "load_in_8bit": false,
    })
}

/// The `quantization_config` object for `format`. `dtype` is the linears' stored dtype (NF4's
/// compute dtype; unused by the other formats).
pub fn quantization_config(format: QuantFormat, dtype: SourceDtype) -> Value {
    match format {
        QuantFormat::Nvfp4 | QuantFormat::Mxfp4 => compressed_tensors_config(format),
        QuantFormat::Nf4 => bitsandbytes_config(dtype),
    }
}

/// The input config with `quantization_config` set (replacing any earlier one).
pub fn quantized_config(
    config: &Map<String, Value>,
    format: QuantFormat,
    dtype: SourceDtype,
) -> Value {
    let mut config = config.clone();
    config.insert(
        "quantization_config".into(),
        quantization_config(format, dtype),
    );
    Value::Object(config)
}

/// The text of `config.json` as the Python library for `format` writes it.
pub fn config_text(config: &Value, format: QuantFormat) -> String {
    let mut text = pyjson::dumps(config, true);
    if format == QuantFormat::Nf4 {
        text.push('\n');
    }
    text
}
