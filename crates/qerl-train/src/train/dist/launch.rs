//! Starting ranks: torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) read by each rank, and [`spawn_local`], which starts N copies of the current
//! program on this host with that environment set (what `qerl train --gpus N` does) and watches
//! them: the first rank to fail is named, and the others are stopped if they do not end by
//! themselves (they normally do: their next collective fails on the missing rank).

use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// What a rank reads from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The device index on this host.
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`: where rank 0 listens.
    pub master: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{name} is `{value}`: expected a non-negative integer")]
    BadVar { name: &'static str, value: String },
    #[error("{0} must be set when WORLD_SIZE is")]
    Missing(&'static str),
    #[error("RANK {rank} is not below WORLD_SIZE {world}")]
    RankRange { rank: usize, world: usize },
    #[error("cannot start rank {rank}: {source}")]
    Spawn {
        rank: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank} failed ({status}); the other ranks were stopped")]
    RankFailed { rank: usize, status: String },
}

impl RankEnv {
    /// From the process environment; `None` when `WORLD_SIZE` is unset (a single process).
    pub fn from_env() -> Result<Option<Self>, LaunchError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From any lookup (tests). `LOCAL_RANK` defaults to `RANK`, `MASTER_ADDR` to 127.0.0.1.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, LaunchError> {
        let num = |name: &'static str| -> Result<Option<usize>, LaunchError> {
            var(name)
                .map(|v| {
                    v.trim().parse().map_err(|_| LaunchError::BadVar {
                        name,
                        value: v.clone(),
                    })
                })
                .transpose()
        };
        let Some(world) = num("WORLD_SIZE")? else {
            return Ok(None);
        };
        let rank = num("RANK")?.ok_or(LaunchError::Missing("RANK"))?;
        if rank >= world {
            return Err(LaunchError::RankRange { rank, world });
        }
        let port = num("MASTER_PORT")?.ok_or(LaunchError::Missing("MASTER_PORT"))?;
        let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        Ok(Some(RankEnv {
            rank,
            world_size: world,
            local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
            master: format!("{addr}:{port}"),
        }))
    }
}

/// A free TCP port on this host for rank 0 (taken by the OS, released at once).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Runs `program args` as `n` ranks on this host (`RANK = LOCAL_RANK = 0..n`, `WORLD_SIZE = n`,
/// rank 0 at `127.0.0.1:port`) and waits for all of them. When a rank fails, the others get
/// `grace` to end by themselves before they are killed; the error names the first rank that
/// failed.
pub fn spawn_local(
    program: &Path,
    args: &[String],
    n: usize,
    port: u16,
    grace: Duration,
) -> Result<(), LaunchError> {
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let child = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(source) => {
                kill_all(&mut children);
                return Err(LaunchError::Spawn { rank, source });
            }
        }
    }
    let mut first_failure: Option<(usize, ExitStatus)> = None;
    let mut failed_at = None;
    loop {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            if let Ok(Some(status)) = c.try_wait() {
                *slot = None;
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((rank, status));
                    failed_at = Some(Instant::now());
                }
            }
        }
        if children.iter().all(Option::is_none) {
            break;
        }
        if failed_at.is_some_and(|t| t.elapsed() > grace) {
            kill_all(&mut children);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match first_failure {
        Some((rank, status)) => Err(LaunchError::RankFailed {
            rank,
            status: status.to_string(),
        }),
        None => Ok(()),
    }
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(kv: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn torchrun_variables() {
        assert_eq!(RankEnv::from_vars(vars(&[])).unwrap(), None);
        let e = RankEnv::from_vars(vars(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, 1));
        assert_eq!(e.master, "node0:29500");
        let bad = RankEnv::from_vars(vars(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "2"),
            ("MASTER_PORT", "1"),
        ]));
        assert!(matches!(
            bad,
            Err(LaunchError::RankRange { rank: 2, world: 2 })
        ));
        let missing = RankEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "0")]));
        assert!(matches!(missing, Err(LaunchError::Missing("MASTER_PORT"))));
    }

    #[test]
    fn a_failing_rank_is_named_and_the_others_stopped() {
        // rank 1 fails at once, rank 0 would sleep for a minute
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60";
        let start = Instant::now();
        let err = spawn_local(
            Path::new("/bin/sh"),
            &["-c".into(), script.into()],
            2,
            free_port().unwrap(),
            Duration::from_millis(500),
        )
        .unwrap_err();
        assert!(
            matches!(err, LaunchError::RankFailed { rank: 1, .. }),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(30));
    }
}
