//! `qerl train --config FILE.toml [--set key=value ...] [--resume DIR] [--device auto|cpu|wgpu|cuda]
//! [--gpus N]`.
//!
//! Data parallelism (docs/distributed.md): `--gpus N` starts N ranks of this same command on
//! this host, one GPU each; a process started with torchrun's variables (`WORLD_SIZE`, `RANK`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) is one rank of such a group. Ranks talk through
//! NCCL on CUDA (gradients) and TCP to rank 0 (everything small, and all of it on CPU / wgpu).
//!
//! GRPO / DAPO / Dr. GRPO post-training of a frozen (NVFP4 or BF16) model through LoRA (and
//! optionally its RMSNorm weights), with AQN noise in the norms. The loop lives in the
//! `qerl_train` library (`src/train`): see its docs for what is written where.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use qerl_rl::TrainConfig;
use qerl_train::checkpoint::{resolve_checkpoint, resume_run_dir, CONFIG_FILE};
use qerl_train::dist::launch::{free_port, spawn_local, RankEnv};
use qerl_train::dist::{tcp::TcpComm, Communicator, Single};
use qerl_train::run_dir::{prepare_fresh, RunDirLock};
use qerl_train::{RunOptions, TrainBackend, TrainSetup, Trainer};

/// Where training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TrainDevice {
    /// CUDA when this build has it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run's TOML config (see configs/); with --resume, default: the checkpoint's own.
    #[arg(long, required_unless_present = "resume")]
    pub config: Option<PathBuf>,
    /// Override a config value, e.g. `--set optim.lr=1e-5` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue a run from a checkpoint directory (or a run directory: its latest checkpoint).
    /// The run goes on in that run directory, whatever the checkpoint's config names (or in the
    /// `train.output_dir` given with --set, which must then be new or empty, or --overwrite).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start afresh in a run directory that already holds a run, removing that run's
    /// checkpoints, metrics and plot first (without it such a directory is refused).
    #[arg(long)]
    pub overwrite: bool,
    /// tokenizer.json when the model directory has none.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = TrainDevice::Auto)]
    pub device: TrainDevice,
    /// Stop after this many steps of this invocation (a checkpoint is written; resume later).
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Stop at the first step boundary after this many seconds (a checkpoint is written;
    /// resume later).
    #[arg(long)]
    pub time_budget: Option<f64>,
    /// Feed prompts as plain text instead of the ChatML template.
    #[arg(long)]
    pub no_chat: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Data-parallel ranks on this host, one GPU each (`LOCAL_RANK` = device index): starts
    /// this command once per rank. With `--device cpu` or `wgpu` the ranks share the device
    /// (for trying the machinery out).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Seconds a rank waits in a collective for the others before the run ends naming the
    /// ranks that did not come (a rollout of the slowest rank must fit in it).
    #[arg(long, default_value_t = 1800)]
    pub dist_timeout: u64,
}

fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists() || std::path::Path::new("/dev/nvidia0").exists()
}

pub fn run(args: Args) -> Result<()> {
    let rank_env = RankEnv::from_env()?;
    anyhow::ensure!(args.gpus >= 1, "--gpus must be at least 1");
    // also in the launcher: a Ctrl-C reaches every rank (same process group), which stop at
    // the same step and checkpoint; the launcher keeps waiting for them
    qerl_train::signal::install();
    if args.gpus > 1 && rank_env.is_none() {
        // the launcher: the ranks are this same command line with torchrun's variables set
        let program = std::env::current_exe().context("cannot find the qerl executable")?;
        let argv: Vec<String> = std::env::args().skip(1).collect();
        eprintln!("starting {} ranks", args.gpus);
        spawn_local(
            &program,
            &argv,
            args.gpus,
            free_port()?,
            std::time::Duration::from_secs(30),
        )?;
        return Ok(());
    }
    if let Some(env) = &rank_env {
        anyhow::ensure!(
            args.gpus == 1 || args.gpus == env.world_size,
            "--gpus {} disagrees with WORLD_SIZE {}",
            args.gpus,
            env.world_size
        );
    }
    let resume = args.resume.as_deref().map(resolve_checkpoint).transpose()?;
    let config_path = match (&args.config, &resume) {
        (Some(c), _) => c.clone(),
        (None, Some(dir)) => dir.join(CONFIG_FILE),
        (None, None) => unreachable!("clap requires --config without --resume"),
    };
    let mut config = TrainConfig::load(&config_path, &args.set)?;
    // A resumed run continues in the run directory it came from, unless told where to go.
    let continues_in_place = match &args.resume {
        Some(arg) => {
            let run_dir = resume_run_dir(arg);
            let explicit = args
                .set
                .iter()
                .any(|s| s.trim_start().starts_with("train.output_dir"));
            if !explicit {
                config.train.output_dir = run_dir.clone();
            }
            same_dir(&config.train.output_dir, &run_dir)
        }
        None => false,
    };
    let model = qerl_model::ModelConfig::from_dir(&config.model.dir)?;
    qerl_train::limits::check_against_model(&config, &model)
        .with_context(|| format!("`{}`", config_path.display()))?;
    // rank 0 alone writes the run directory; the lock lives as long as this function
    let writes = rank_env.as_ref().is_none_or(|e| e.rank == 0);
    let _lock = if writes {
        let lock = RunDirLock::acquire(&config.train.output_dir)?;
        if !continues_in_place {
            prepare_fresh(&lock, args.overwrite)?;
        }
        Some(lock)
    } else {
        None
    };
    let mut setup = TrainSetup::from_config(config, args.tokenizer.as_deref())?;
    setup.chat = !args.no_chat;
    let device = match args.device {
        TrainDevice::Auto if cfg!(feature = "cuda") && gpu_present() => TrainDevice::Cuda,
        TrainDevice::Auto => TrainDevice::Cpu,
        d => d,
    };
    let options = RunOptions {
        progress: !args.quiet,
        max_steps: args.max_steps,
        time_budget: args.time_budget,
    };
    let timeout = std::time::Duration::from_secs(args.dist_timeout);
    let rank = Rank {
        env: rank_env,
        timeout,
    };
    match &rank.env {
        Some(e) => eprintln!(
            "rank {}/{} (local rank {}) training on {device:?}",
            e.rank, e.world_size, e.local_rank
        ),
        None => eprintln!("training on {device:?}"),
    }
    match device {
        TrainDevice::Cpu => {
            let comm = rank.tcp()?;
            go::<burn::backend::Autodiff<qerl_nn::backends::Cpu>>(setup, resume, &options, comm, 0)
        }
        #[cfg(feature = "wgpu")]
        TrainDevice::Wgpu => {
            qerl_kernels::runtime::wgpu_device()?;
            let comm = rank.tcp()?;
            go::<burn::backend::Autodiff<qerl_nn::backends::Wgpu>>(setup, resume, &options, comm, 0)
        }
        #[cfg(feature = "cuda")]
        TrainDevice::Cuda => {
            let comm = rank.nccl()?;
            go::<burn::backend::Autodiff<qerl_nn::backends::Cuda>>(
                setup,
                resume,
                &options,
                comm,
                rank.local_rank(),
            )
        }
        #[allow(unreachable_patterns)]
        other => anyhow::bail!("this build of qerl has no {other:?} support (see --features)"),
    }
}

/// This process's place in a data-parallel group (`env` is `None` for a single process).
struct Rank {
    env: Option<RankEnv>,
    timeout: std::time::Duration,
}

impl Rank {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn local_rank(&self) -> usize {
        self.env.as_ref().map_or(0, |e| e.local_rank)
    }

    /// Everything over TCP (CPU and wgpu ranks).
    fn tcp(&self) -> Result<Box<dyn Communicator>> {
        Ok(match &self.env {
            None => Box::new(Single),
            Some(e) => Box::new(
                TcpComm::connect(e.rank, e.world_size, &e.master, self.timeout)
                    .context("cannot join the process group")?,
            ),
        })
    }

    /// Gradients through NCCL on the rank's GPU, the rest over TCP.
    #[cfg(feature = "cuda")]
    fn nccl(&self) -> Result<Box<dyn Communicator>> {
        Ok(match &self.env {
            None => Box::new(Single),
            Some(e) => Box::new(
                qerl_train::dist::nccl::NcclComm::connect(
                    e.rank,
                    e.world_size,
                    e.local_rank,
                    &e.master,
                    self.timeout,
                )
                .context("cannot join the NCCL group")?,
            ),
        })
    }
}

/// Whether two paths name one directory (the same path, or both existing and canonically equal).
fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// The backend's device number `index` (the rank's GPU under data parallelism).
fn device_at<B: TrainBackend>(index: usize) -> B::Device {
    use burn::tensor::backend::Device as _;
    let device = B::Device::default();
    if index == 0 {
        return device;
    }
    let mut id = device.to_id();
    id.index_id = index as _;
    B::Device::from_id(id)
}

fn go<B: TrainBackend>(
    setup: TrainSetup,
    resume: Option<PathBuf>,
    options: &RunOptions,
    comm: Box<dyn Communicator>,
    device_index: usize,
) -> Result<()> {
    let device = device_at::<B>(device_index);
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut trainer = match &resume {
        Some(dir) => {
            let t = Trainer::<B>::resume(setup, dir, &device)?;
            if rank == 0 {
                eprintln!("resumed from `{}` at step {}", dir.display(), t.state.step);
            }
            t
        }
        None => Trainer::<B>::new(setup, &device)?,
    }
    .with_communicator(comm);
    let out = qerl_train::run(&mut trainer, options).with_context(|| match world {
        1 => "training failed".to_string(),
        _ => format!("training failed on rank {rank} of {world}"),
    })?;
    if rank != 0 {
        return Ok(());
    }
    if let Some(m) = out.metrics.last() {
        eprintln!(
            "step {}/{}: reward {:.3}, accuracy {:.3}, loss {:+.4}",
            out.steps,
            trainer.config().train.steps,
            m.reward_mean,
            m.accuracy,
            m.loss
        );
    }
    if let Some(c) = &out.checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
    eprintln!(
        "metrics: {} (plot: {})",
        out.metrics_path.display(),
        out.plot_path.display()
    );
    if out.interrupted {
        eprintln!(
            "interrupted: resume with `qerl train --resume {}`",
            trainer.config().train.output_dir.display()
        );
    }
    Ok(())
}
