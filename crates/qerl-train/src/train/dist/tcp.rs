//! [`TcpComm`]: a process group over TCP with rank 0 as the hub (torchrun's conventions: rank
//! 0 listens on `MASTER_PORT`, the others connect to `MASTER_ADDR:MASTER_PORT`).
//!
//! Each collective: every other rank sends its frame to rank 0, which reads them in rank order
//! and sends every rank all of them. It carries the small host records of a step (rewards,
//! counts, flags), the NCCL unique id, and on CPU the gradient all-reduce. Rank 0 sees a rank
//! that dies (its connection closes) or hangs (no frame within the timeout), and sends the
//! others an error frame naming it, so every rank's message names the rank at fault.
//!
//! Wire format, little endian: a frame is `op: u8`, `len: u64`, `len` bytes. Rank 0's reply to
//! a collective is one frame whose payload is `world` times `len: u64` + bytes; an `ERROR` frame
//! carries a UTF-8 message instead.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{f32_bytes, sum_in_rank_order, CommError, Communicator};

const MAGIC: &[u8; 4] = b"QERL";
const OP_REDUCE: u8 = 1;
const OP_GATHER: u8 = 2;
const OP_ERROR: u8 = 0xEE;

fn op_name(op: u8) -> String {
    match op {
        OP_REDUCE => "all_reduce_sum".into(),
        OP_GATHER => "all_gather".into(),
        OP_ERROR => "error".into(),
        o => format!("op {o}"),
    }
}

enum Peers {
    /// Rank 0: a connection to every other rank (index = rank; index 0 unused).
    Hub(Vec<Option<TcpStream>>),
    /// Any other rank: the connection to rank 0.
    Leaf(TcpStream),
}

/// One rank of a TCP process group.
pub struct TcpComm {
    rank: usize,
    world: usize,
    timeout: Duration,
    peers: Mutex<Peers>,
    seq: Mutex<u64>,
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommError {
    let context = context.into();
    move |source| CommError::Io { context, source }
}

fn write_frame(s: &mut TcpStream, op: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = op;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes")) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

impl TcpComm {
    /// Joins the group: rank 0 listens on `addr`'s port (all interfaces) and waits for the
    /// `world - 1` others; the others connect to `addr` (retrying while rank 0 starts). Gives
    /// up after `timeout`, naming the ranks that never came.
    pub fn connect(
        rank: usize,
        world: usize,
        addr: &str,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::Setup(format!(
                "rank {rank} of world size {world}"
            )));
        }
        let deadline = Instant::now() + timeout;
        let target: SocketAddr = addr
            .to_socket_addrs()
            .map_err(io(format!("cannot resolve `{addr}`")))?
            .next()
            .ok_or_else(|| CommError::Setup(format!("`{addr}` resolves to no address")))?;
        let peers = if rank == 0 {
            Peers::Hub(Self::accept_all(world, target.port(), deadline, timeout)?)
        } else {
            Peers::Leaf(Self::dial(rank, world, target, deadline)?)
        };
        Ok(TcpComm {
            rank,
            world,
            timeout,
            peers: Mutex::new(peers),
            seq: Mutex::new(0),
        })
    }

    fn accept_all(
        world: usize,
        port: u16,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<Option<TcpStream>>, CommError> {
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(io(format!("rank 0 cannot listen on port {port}")))?;
        listener.set_nonblocking(true).map_err(io("listener"))?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        while peers.iter().skip(1).any(Option::is_none) {
            match listener.accept() {
                Ok((mut s, from)) => {
                    s.set_nonblocking(false).map_err(io("accept"))?;
                    s.set_read_timeout(Some(Duration::from_secs(10)))
                        .map_err(io("accept"))?;
                    let mut hello = [0u8; 12];
                    if s.read_exact(&mut hello).is_err() || &hello[..4] != MAGIC {
                        continue; // not one of ours (a port scan, a stale client)
                    }
                    let r = u32::from_le_bytes(hello[4..8].try_into().expect("4")) as usize;
                    let w = u32::from_le_bytes(hello[8..].try_into().expect("4")) as usize;
                    if w != world || r == 0 || r >= world || peers[r].is_some() {
                        return Err(CommError::Setup(format!(
                            "{from} joined as rank {r} of world size {w}; rank 0 expects world size {world} and unique ranks 1..{world}"
                        )));
                    }
                    s.set_nodelay(true).map_err(io("accept"))?;
                    peers[r] = Some(s);
                }
                Err(e) if timed_out(&e) => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (1..world).filter(|&r| peers[r].is_none()).collect();
                        return Err(CommError::Timeout {
                            ranks: missing,
                            op: "rendezvous".into(),
                            seq: 0,
                            timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(io("accept")(e)),
            }
        }
        for s in peers.iter_mut().flatten() {
            write_frame(s, OP_GATHER, &[]).map_err(io("rendezvous reply"))?;
        }
        Ok(peers)
    }

    fn dial(
        rank: usize,
        world: usize,
        target: SocketAddr,
        deadline: Instant,
    ) -> Result<TcpStream, CommError> {
        let mut s = loop {
            match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(CommError::Io {
                        context: format!("rank {rank} cannot reach rank 0 at {target}"),
                        source: e,
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        s.set_nodelay(true).map_err(io("connect"))?;
        let mut hello = MAGIC.to_vec();
        hello.extend((rank as u32).to_le_bytes());
        hello.extend((world as u32).to_le_bytes());
        s.write_all(&hello).map_err(io("hello to rank 0"))?;
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .map_err(io("connect"))?;
        read_frame(&mut s).map_err(|e| CommError::Io {
            context: format!("rank {rank}: rank 0 did not complete the rendezvous"),
            source: e,
        })?;
        Ok(s)
    }

    /// The collective: every rank's payload, in rank order.
    fn exchange(&self, op: u8, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let mut seq_guard = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *seq_guard;
        *seq_guard += 1;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *peers {
            Peers::Hub(conns) => self.hub(conns, op, seq, payload),
            Peers::Leaf(s) => self.leaf(s, op, seq, &payload),
        }
    }

    fn hub(
        &self,
        conns: &mut [Option<TcpStream>],
        op: u8,
        seq: u64,
        payload: Vec<u8>,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut parts = vec![payload];
        let mut failure = None;
        for (r, conn) in conns.iter_mut().enumerate().skip(1) {
            let s = conn.as_mut().expect("every rank is connected");
            let left = deadline.saturating_duration_since(Instant::now());
            let got = s
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .and_then(|_| read_frame(s));
            match got {
                Ok((o, p)) if o == op => parts.push(p),
                Ok((o, _)) => {
                    failure = Some(CommError::Mismatch {
                        rank: r,
                        seq,
                        ours: op_name(op),
                        theirs: op_name(o),
                    })
                }
                Err(e) if timed_out(&e) => {
                    failure = Some(CommError::Timeout {
                        ranks: vec![r],
                        op: op_name(op),
                        seq,
                        timeout: self.timeout,
                    })
                }
                Err(_) => {
                    failure = Some(CommError::PeerGone {
                        rank: r,
                        op: op_name(op),
                        seq,
                    })
                }
            }
            if failure.is_some() {
                break;
            }
        }
        if let Some(err) = failure {
            let msg = format!("rank 0 reports: {err}");
            for s in conns.iter_mut().flatten() {
                let _ = write_frame(s, OP_ERROR, msg.as_bytes());
            }
            return Err(err);
        }
        let mut reply = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
        for p in &parts {
            reply.extend((p.len() as u64).to_le_bytes());
            reply.extend_from_slice(p);
        }
        for (r, conn) in conns.iter_mut().enumerate().skip(1) {
            let s = conn.as_mut().expect("every rank is connected");
            s.set_write_timeout(Some(self.timeout))
                .and_then(|_| write_frame(s, op, &reply))
                .map_err(|_| CommError::PeerGone {
                    rank: r,
                    op: op_name(op),
                    seq,
                })?;
        }
        Ok(parts)
    }

    fn leaf(
        &self,
        s: &mut TcpStream,
        op: u8,
        seq: u64,
        payload: &[u8],
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let gone = || CommError::PeerGone {
            rank: 0,
            op: op_name(op),
            seq,
        };
        // rank 0 may wait a whole timeout for a slower rank before it answers
        let patience = 2 * self.timeout;
        s.set_write_timeout(Some(patience))
            .and_then(|_| write_frame(s, op, payload))
            .map_err(|_| gone())?;
        s.set_read_timeout(Some(patience))
            .map_err(io("read timeout"))?;
        let (o, reply) = match read_frame(s) {
            Ok(f) => f,
            Err(e) if timed_out(&e) => {
                return Err(CommError::Timeout {
                    ranks: vec![0],
                    op: op_name(op),
                    seq,
                    timeout: patience,
                })
            }
            Err(_) => return Err(gone()),
        };
        if o == OP_ERROR {
            return Err(CommError::Remote(String::from_utf8_lossy(&reply).into()));
        }
        let mut parts = Vec::with_capacity(self.world);
        let mut at = 0;
        while at < reply.len() {
            let len = u64::from_le_bytes(reply[at..at + 8].try_into().expect("8")) as usize;
            parts.push(reply[at + 8..at + 8 + len].to_vec());
            at += 8 + len;
        }
        if parts.len() != self.world {
            return Err(CommError::Remote(format!(
                "rank 0 answered collective #{seq} with {} parts for {} ranks",
                parts.len(),
                self.world
            )));
        }
        Ok(parts)
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), CommError> {
        let parts = self.exchange(OP_REDUCE, f32_bytes(data))?;
        sum_in_rank_order(&parts, data)
    }

    fn all_gather(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.exchange(OP_GATHER, local.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn three_ranks_reduce_and_gather() {
        let addr = format!("127.0.0.1:{}", free_port());
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let c = TcpComm::connect(rank, 3, &addr, Duration::from_secs(20)).unwrap();
                    let mut v = vec![rank as f32 + 0.5; 4];
                    c.all_reduce_sum(&mut v).unwrap();
                    let g = c.all_gather(format!("r{rank}").as_bytes()).unwrap();
                    c.barrier().unwrap();
                    (v, g)
                })
            })
            .collect();
        for h in handles {
            let (v, g) = h.join().unwrap();
            assert_eq!(v, vec![4.5; 4]);
            assert_eq!(g, vec![b"r0".to_vec(), b"r1".to_vec(), b"r2".to_vec()]);
        }
    }

    #[test]
    fn a_rank_that_leaves_is_named_by_every_other_rank() {
        let addr = format!("127.0.0.1:{}", free_port());
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let c = TcpComm::connect(rank, 3, &addr, Duration::from_secs(20)).unwrap();
                    c.barrier().unwrap();
                    if rank == 1 {
                        return String::new(); // dropped: its connection closes
                    }
                    c.barrier().unwrap_err().to_string()
                })
            })
            .collect();
        let msgs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(msgs[0].starts_with("rank 1 left the run"), "{}", msgs[0]);
        assert!(msgs[2].contains("rank 1 left the run"), "{}", msgs[2]);
    }

    #[test]
    fn a_rank_that_hangs_is_named_after_the_timeout() {
        let addr = format!("127.0.0.1:{}", free_port());
        let t = Duration::from_millis(400);
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let c = TcpComm::connect(rank, 2, &addr, Duration::from_secs(20)).unwrap();
                    let c = TcpComm { timeout: t, ..c };
                    if rank == 1 {
                        std::thread::sleep(Duration::from_secs(2));
                        return String::new();
                    }
                    c.barrier().unwrap_err().to_string()
                })
            })
            .collect();
        let msgs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            msgs[0].starts_with("rank 1 did not reach collective #0"),
            "{}",
            msgs[0]
        );
    }
}
