//! The trainer library behind `qerl train`, `qerl eval` and `qerl reward`.
//!
//! | module | what |
//! | --- | --- |
//! | [`trainer`] | [`Trainer`]: rollouts on the graph-free view of the policy, GRPO / DAPO / Dr. GRPO updates, checkpoints, resume |
//! | [`run`] | the step loop: metrics JSONL, progress bar, PNG plot, periodic checkpoints, Ctrl-C |
//! | [`rollout`] | prompts, batched sampling of G completions per prompt, scoring |
//! | [`update`] | the training batch, old / reference log-probs, `mu` AdamW steps with accumulation and global clipping |
//! | [`noise`] | AQN noise vectors folded into the RMSNorm weights |
//! | [`peft`] | the PEFT adapter writer, norm weights, host tensors |
//! | [`checkpoint`] | atomic checkpoint directories and the trainer state |
//! | [`run_dir`] | the run directory's lock, and what a fresh run may find there |
//! | [`output_path`] | refusing an output file that is one of the inputs |
//! | [`load_options`] | the `[model]` and `[lora]` config sections as the loader's options |
//! | [`limits`] | a run's sizes held to the model's before anything is allocated |
//! | [`out_of_memory`] | running out of device memory reported as an error that says what to change |
//! | [`signal`] | the Ctrl-C flag |
//! | [`dist`] | data parallelism: the communicator (in-process, TCP, NCCL), torchrun's environment, `--gpus N` |
//! | [`dp`] | the data-parallel pieces of a step: global dynamic sampling, gradient all-reduce, reduced metrics |
//! | [`evaluate`] | held-out accuracy (pass@1, strict and flexible), shared by `qerl eval`, `qerl sft` and the demo |
//! | [`sft`] | supervised full-parameter training of a small model from scratch (`qerl sft`) |
//! | [`bpe`] | training a byte-level BPE tokenizer with the ChatML tokens |

pub mod bpe;
pub mod checkpoint;
pub mod dist;
pub mod dp;
pub mod engine_rollout;
pub mod evaluate;
pub mod limits;
pub mod load_options;
pub mod noise;
pub mod out_of_memory;
pub mod output_path;
pub mod peft;
pub mod rollout;
pub mod run;
pub mod run_dir;
pub mod sft;
pub mod signal;
pub mod trainer;
pub mod update;

pub use run::{run, RunOptions, RunOutcome};
pub use trainer::{TrainBackend, TrainSetup, Trainer};
