use qerl_rl::aqn::SigmaSchedule;
use qerl_rl::config::*;
use qerl_rl::data::DatasetKind;
use qerl_rl::loss::LossAggregation;

const MINIMAL: &str = "[model]\ndir = \"m\"\n";

fn parse(text: &str) -> Result<TrainConfig, ConfigError> {
    TrainConfig::from_toml_str(text, "test.toml")
}

fn with_set(text: &str, sets: &[&str]) -> Result<TrainConfig, ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    TrainConfig::from_toml_with_overrides(text, "test.toml", &sets)
}

fn invalid_key(e: ConfigError) -> String {
    match e {
        ConfigError::Invalid { key, .. } => key,
        other => panic!("expected a validation error, got {other}"),
    }
}

#[test]
fn defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.model.precision, Precision::Nvfp4);
    assert_eq!(
        (c.lora.rank, c.lora.alpha, c.lora.train_norms),
        (16, 16.0, true)
    );
    assert_eq!(c.loss.kind, LossKind::Grpo);
    assert_eq!(
        (c.loss.eps_low, c.loss.eps_high(), c.loss.beta()),
        (0.2, 0.2, 0.04)
    );
    assert!(!c.loss.dynamic_sampling());
    assert_eq!(c.loss.overlong_buffer(2048), 0);
    assert_eq!(c.aqn.schedule, SigmaSchedule::Exponential);
    assert_eq!(
        (c.aqn.sigma_start, c.aqn.sigma_end, c.aqn.num_stages),
        (1e-2, 5e-4, 10)
    );
    assert!(c.aqn.rollouts_only);
    assert_eq!((c.eval.temperature, c.eval.top_p), (0.6, 0.95));
    assert_eq!(
        (c.optim.lr, c.optim.grad_clip, c.optim.weight_decay),
        (1e-5, 0.2, 0.1)
    );
    let names: Vec<String> = c.reward_specs().into_iter().map(|r| r.name).collect();
    assert_eq!(names, ["format", "gsm8k"]);
    assert_eq!(c.reward_set().unwrap().weights(), [0.2, 2.0]);
    assert_eq!(c.lr_schedule().warmup_steps, 50);
}

#[test]
fn kind_dependent_defaults() {
    let c = parse("[model]\ndir = \"m\"\n[loss]\nkind = \"dapo\"\n").unwrap();
    assert_eq!((c.loss.eps_high(), c.loss.beta()), (0.28, 0.0));
    assert!(c.loss.dynamic_sampling() && c.loss.mask_truncated());
    assert_eq!(c.loss.overlong_buffer(2048), 409);
    assert_eq!(
        c.loss.policy_loss(2048).aggregation,
        LossAggregation::TokenMean
    );
    let c = parse("[model]\ndir = \"m\"\n[loss]\nkind = \"dr_grpo\"\n").unwrap();
    assert_eq!(
        c.loss.policy_loss(512).aggregation,
        LossAggregation::ConstantNormalizer { max_len: 512 }
    );
    assert_eq!(
        c.loss.advantage_kind(),
        qerl_rl::advantage::AdvantageKind::DrGrpo
    );
    // Explicit values win over the kind's defaults.
    let c = parse(
        "[model]\ndir = \"m\"\n[loss]\nkind = \"dapo\"\neps_high = 0.3\ndynamic_sampling = false\n",
    )
    .unwrap();
    assert_eq!(c.loss.eps_high(), 0.3);
    assert!(!c.loss.dynamic_sampling());
}

#[test]
fn resolved_config_round_trips() {
    let c = parse("[model]\ndir = \"m\"\n[loss]\nkind = \"dapo\"\n[data]\ndataset = \"math500\"\n")
        .unwrap();
    let r = c.resolved();
    assert_eq!(r.loss.overlong_buffer, Some(409));
    assert_eq!(r.rewards[1].name, "math");
    let again = parse(&r.to_toml()).unwrap();
    assert_eq!(again, r);
    assert_eq!(parse(&c.to_toml()).unwrap(), c);
}

#[test]
fn unknown_keys_are_rejected_with_their_name() {
    let e = parse("[model]\ndir = \"m\"\n[loss]\nepsilon = 0.3\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("test.toml") && e.contains("epsilon"), "{e}");
    let e = parse("[model]\ndir = \"m\"\nlearning_rate = 1\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("learning_rate"), "{e}");
    let e = parse("[model]\ndir = \"m\"\nprecision = \"fp8\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fp8"), "{e}");
    let e = parse("[lora]\nrank = 4\n").unwrap_err().to_string();
    assert!(e.contains("model"), "a missing [model] table is named: {e}");
    let e = parse("[model\n").unwrap_err().to_string();
    assert!(e.contains("test.toml"), "{e}");
}

#[test]
fn validation_names_the_key() {
    let cases = [
        ("[loss]\neps_low = 1.5\n", "loss.eps_low"),
        ("[loss]\nmu = 0\n", "loss.mu"),
        ("[loss]\ntis_cap = 0.5\n", "loss.tis_cap"),
        ("[loss]\noverlong_buffer = 5000\n", "loss.overlong_buffer"),
        ("[rollout]\ngroup_size = 1\n", "rollout.group_size"),
        ("[rollout]\ntop_p = 0.0\n", "rollout.top_p"),
        ("[rollout]\ntemperature = -1.0\n", "rollout.temperature"),
        ("[optim]\nlr = 0.0\n", "optim.lr"),
        ("[optim]\nwarmup_ratio = 2.0\n", "optim.warmup_ratio"),
        ("[optim]\ngrad_accum = 0\n", "optim.grad_accum"),
        ("[aqn]\nnum_stages = 1\n", "aqn.num_stages"),
        ("[aqn]\nsigma_end = 0.0\n", "aqn.sigma_end"),
        ("[lora]\nrank = 0\n", "lora.rank"),
        ("[data]\ndataset = \"jsonl\"\n", "data.path"),
        ("[train]\nsteps = 0\n", "train.steps"),
        ("[eval]\nsamples = 0\n", "eval.samples"),
        ("[[rewards]]\nname = \"bleu\"\n", "rewards[0].name"),
        ("[[rewards]]\nname = \"gsm8k\"\naccuracy = true\n[[rewards]]\nname = \"format\"\naccuracy = true\n", "rewards"),
    ];
    for (extra, key) in cases {
        let e = parse(&format!("{MINIMAL}{extra}")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{key}:")), "{extra:?}: {msg}");
        assert_eq!(invalid_key(e), key);
    }
    // No noise at all is fine with schedule = "none".
    parse(&format!(
        "{MINIMAL}[aqn]\nschedule = \"none\"\nsigma_start = 0.0\nsigma_end = 0.0\n"
    ))
    .unwrap();
}

#[test]
fn set_overrides() {
    let c = with_set(
        MINIMAL,
        &[
            "loss.kind=dapo",
            "optim.lr=3e-5",
            "model.dir=/models/q7b",
            "rollout.group_size = 16",
            "aqn.rollouts_only=false",
            "lora.targets=[\"q_proj\", \"v_proj\"]",
            "rewards=[{name = \"gsm8k_flexible\", weight = 1.0, accuracy = true}]",
            "data.prompt.system=Answer briefly.",
        ],
    )
    .unwrap();
    assert_eq!(c.loss.kind, LossKind::Dapo);
    assert_eq!(c.optim.lr, 3e-5);
    assert_eq!(c.model.dir.to_str(), Some("/models/q7b"));
    assert_eq!(c.rollout.group_size, 16);
    assert!(!c.aqn.rollouts_only);
    assert_eq!(c.lora.targets, ["q_proj", "v_proj"]);
    assert_eq!(c.reward_specs()[0].name, "gsm8k_flexible");
    assert_eq!(c.data.prompt.system.as_deref(), Some("Answer briefly."));
    // Later overrides win.
    let c = with_set(MINIMAL, &["optim.lr=1e-4", "optim.lr=2e-4"]).unwrap();
    assert_eq!(c.optim.lr, 2e-4);
}

#[test]
fn bad_overrides_name_the_key() {
    let e = with_set(MINIMAL, &["loss.kind"]).unwrap_err().to_string();
    assert!(
        e.contains("--set loss.kind") && e.contains("key=value"),
        "{e}"
    );
    let e = with_set(MINIMAL, &["model.dir.x=1"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.dir") && e.contains("not a table"), "{e}");
    let e = with_set(MINIMAL, &["loss.nope=1"]).unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("--set"), "{e}");
    let e = with_set(MINIMAL, &["loss..kind=dapo"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty component"), "{e}");
    let e = with_set(MINIMAL, &["loss.eps_low=0.9999"]).unwrap_err();
    assert_eq!(invalid_key(e), "loss.eps_low");
    let e = with_set(MINIMAL, &["loss.kind=ppo"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("ppo"), "{e}");
}

#[test]
fn shipped_configs_parse() {
    let dir = crate::repo_root().join("configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let c = TrainConfig::load(&p, &[]).unwrap_or_else(|e| panic!("{e}"));
        // Every shipped config points at vendored data (relative paths: from the repository
        // root, where the configs are run).
        let file = c.data.file().unwrap();
        let file = if file.is_relative() {
            crate::repo_root().join(file)
        } else {
            file
        };
        assert!(
            file.is_file() || c.data.dataset == DatasetKind::Jsonl,
            "{}",
            p.display()
        );
        n += 1;
    }
    assert!(n >= 6, "expected the paper configs and tiny-cpu, found {n}");

    let c = TrainConfig::load(&dir.join("qwen2.5-7b-gsm8k-grpo.toml"), &[]).unwrap();
    assert_eq!(
        (c.loss.kind, c.loss.beta(), c.loss.eps_high()),
        (LossKind::Grpo, 0.04, 0.2)
    );
    assert_eq!(
        (
            c.rollout.group_size,
            c.rollout.max_completion_tokens,
            c.lora.rank
        ),
        (2, 2048, 16)
    );
    assert_eq!(
        (c.aqn.sigma_start, c.aqn.sigma_end, c.aqn.num_stages),
        (1e-2, 1e-4, 10)
    );
    assert_eq!(
        (c.train.steps, c.train.seed, c.optim.grad_clip),
        (7473, 2025, 0.2)
    );
    let c = TrainConfig::load(&dir.join("qwen2.5-32b-gsm8k-grpo.toml"), &[]).unwrap();
    assert_eq!(c.rollout.group_size, 8);
    let c = TrainConfig::load(
        &dir.join("qwen2.5-7b-gsm8k-dapo.toml"),
        &["loss.dynamic_sampling=true".into()],
    )
    .unwrap();
    assert_eq!(
        (c.loss.kind, c.loss.beta(), c.loss.eps_high()),
        (LossKind::Dapo, 0.0, 0.28)
    );
    assert!(c.loss.dynamic_sampling());
    let e = TrainConfig::load(&dir.join("missing.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.toml"), "{e}");
}

#[test]
fn override_parser() {
    let (k, v) = parse_override("a.b.c = [1, 2]").unwrap();
    assert_eq!(k, ["a", "b", "c"]);
    assert_eq!(v, toml::Value::Array(vec![1.into(), 2.into()]));
    let (_, v) = parse_override("x=hello world").unwrap();
    assert_eq!(v, toml::Value::String("hello world".into()));
    let (_, v) = parse_override("x=\"quoted\"").unwrap();
    assert_eq!(v, toml::Value::String("quoted".into()));
    assert!(parse_override("=1").is_err());
}
