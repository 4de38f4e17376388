//! The training loop on a half-precision backend (wgpu f16, standing in for CUDA bf16), in a
//! process of its own (burn's autotune cache is shared between float types on one device).

mod common;

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_f16_training_step_is_finite_and_starts_on_policy_and_resumes() {
    use burn::backend::Autodiff;
    use qerl_rl::reward::RewardSet;
    use qerl_rl::TrainConfig;
    use qerl_train::{run, RunOptions, TrainSetup, Trainer};
    type H = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, half::f16, i32, u32>;
    let root = common::root();
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root.join("configs/tiny-cpu.toml")).unwrap();
    let make_setup = |steps: usize| {
        let sets = vec![
            format!(
                "model.dir=\"{}\"",
                root.join("tests/fixtures/compressed-tensors/qwen2_tied/nvfp4")
                    .display()
            ),
            format!("train.output_dir=\"{}\"", tmp.path().display()),
            format!("train.steps={steps}"),
            "optim.warmup_ratio=0.5".to_string(),
            "train.eval_interval=0".to_string(),
        ];
        let c = TrainConfig::from_toml_with_overrides(&text, "tiny-cpu", &sets).unwrap();
        c.validate().unwrap();
        let tokenizer = qerl_model::Tokenizer::from_file(
            &root.join("tests/fixtures/tokenizers/tiny/tokenizer.json"),
        )
        .unwrap();
        let examples = common::examples(&["count", "write", "go", "now"], |_| "0");
        TrainSetup {
            config: c.resolved(),
            tokenizer,
            rewards: RewardSet::new().with(common::Digits, 1.0),
            examples,
            chat: false,
        }
    };
    let device = qerl_kernels::runtime::wgpu_device_or_exit();
    let mut t = Trainer::<Autodiff<H>>::new(make_setup(2), &device).unwrap();
    let out = run(&mut t, &RunOptions::default()).unwrap();
    for m in &out.metrics {
        println!("{m:?}");
        // a finite loss and gradient (an f32 loss against bf16/f16 operands was garbage, and
        // half-precision AdamW moments underflowed into NaN weights)
        assert!(
            m.loss.is_finite() && m.grad_norm.is_finite() && m.grad_norm > 0.0,
            "{m:?}"
        );
    }
    // a GPU backend reports its allocator's pool
    assert!(out
        .metrics
        .iter()
        .all(|m| m.peak_memory_bytes.is_some_and(|b| b > 0)));
    // step 0 has learning rate 0 (warmup): its second pass (mu = 2) still sees the rollout
    // policy, so the ratio is 1 everywhere and nothing is clipped
    let m = &out.metrics[0];
    assert_eq!(m.lr, 0.0);
    assert_eq!((m.clip_frac_low, m.clip_frac_high), (0.0, 0.0), "{m:?}");
    assert!(out.metrics[1].lr > 0.0);

    // Resumed from that checkpoint, two more steps: burn loads the optimizer moments in the
    // backend's half type, beside f32 master weights; unconverted, the first update wrote NaN
    // into the adapter (the NaN policy then samples max-length garbage with reward 0).
    drop(t);
    let mut t = Trainer::<Autodiff<H>>::resume(make_setup(4), tmp.path(), &device).unwrap();
    assert_eq!(t.state.step, 2);
    let out = run(&mut t, &RunOptions::default()).unwrap();
    assert_eq!(out.metrics.len(), 2);
    for m in &out.metrics {
        println!("resumed: {m:?}");
        assert!(
            m.loss.is_finite() && m.grad_norm.is_finite() && m.grad_norm > 0.0,
            "{m:?}"
        );
    }
    let lora = qerl_train::peft::linears(t.model())
        .into_iter()
        .filter_map(|(_, l)| {
            l.lora()
                .map(|l| l.b.val().into_data().to_vec::<f32>().unwrap())
        })
        .flatten()
        .collect::<Vec<f32>>();
    assert!(!lora.is_empty() && lora.iter().all(|v| v.is_finite()));
    assert!(lora.iter().any(|v| *v != 0.0));
}
