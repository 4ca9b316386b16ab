//! The host's stdin, read for a session only while the session lasts.
//!
//! tokio reads stdin with a blocking `read` on a thread of its own, which nothing can
//! cancel: once the session is over, that read waits on, and takes the next line the
//! user types at their shell (while `vmctl run` tears its VM down, say), to be dropped
//! when vmctl exits. This reader waits for input with `poll`, beside a wake-up it gets
//! when dropped, and reads only what is there: no read outlives the session.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};

/// Reads `fd` (stdin) on a thread of its own, as asked.
pub struct StdinReader {
    /// How many bytes the next read may take.
    requests: Option<std::sync::mpsc::Sender<usize>>,
    answers: tokio::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    /// A read was asked for and its answer not taken yet (the future that asked was
    /// dropped): the next [`StdinReader::read`] takes it rather than ask again.
    asked: bool,
    /// Wakes the thread's `poll` when the reader is dropped.
    stop: OwnedFd,
}

impl StdinReader {
    /// Starts reading `fd`, a descriptor that stays open for the life of the process
    /// (stdin, or a test's).
    pub fn start(fd: BorrowedFd<'static>) -> io::Result<StdinReader> {
        let stop = eventfd(0, EventfdFlags::CLOEXEC)?;
        let thread_stop = stop.try_clone()?;
        let (requests, wanted) = std::sync::mpsc::channel::<usize>();
        let (answer, answers) = tokio::sync::mpsc::channel(1);
        std::thread::Builder::new()
            .name("stdin".into())
            .spawn(move || {
                while let Ok(max) = wanted.recv() {
                    let Some(read) = read_when_ready(fd, thread_stop.as_fd(), max) else {
                        return;
                    };
                    if answer.blocking_send(read).is_err() {
                        return;
                    }
                }
            })?;
        Ok(StdinReader {
            requests: Some(requests),
            answers,
            asked: false,
            stop,
        })
    }

    /// Reads at most `max` bytes of what is there, once some is: empty at end of file.
    /// Cancel-safe: what a dropped call asked for is the next call's.
    pub async fn read(&mut self, max: usize) -> io::Result<Vec<u8>> {
        let gone = || io::Error::other("the stdin thread ended");
        if !self.asked {
            let requests = self.requests.as_ref().ok_or_else(gone)?;
            requests.send(max.max(1)).map_err(|_| gone())?;
            self.asked = true;
        }
        let answer = self.answers.recv().await.ok_or_else(gone)?;
        self.asked = false;
        answer
    }
}

impl Drop for StdinReader {
    fn drop(&mut self) {
        self.requests = None;
        let _ = rustix::io::write(&self.stop, &1u64.to_ne_bytes());
    }
}

/// Waits until `fd` has input (or its end), then reads at most `max` bytes of it;
/// `None` once `stop` is signalled, having read nothing.
fn read_when_ready(
    fd: BorrowedFd<'_>,
    stop: BorrowedFd<'_>,
    max: usize,
) -> Option<io::Result<Vec<u8>>> {
    loop {
        let mut fds = [
            PollFd::new(&fd, PollFlags::IN),
            PollFd::new(&stop, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Some(Err(e.into())),
        }
        if !fds[1].revents().is_empty() {
            return None;
        }
        if !fds[0].revents().is_empty() {
            break;
        }
    }
    let mut buf = vec![0u8; max];
    loop {
        match rustix::io::read(fd, &mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Some(Ok(buf));
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Some(Err(e.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// What is written to the pipe once its reader is gone stays for whoever reads
    /// next (after time for a stray read to happen, were there one).
    fn assert_the_next_reader_gets_what_comes(
        read_end: &OwnedFd,
        mut write_end: std::io::PipeWriter,
    ) {
        std::thread::sleep(std::time::Duration::from_millis(100));
        write_end.write_all(b"typed after\n").unwrap();
        drop(write_end);
        let mut rest = String::new();
        std::fs::File::from(read_end.try_clone().unwrap())
            .read_to_string(&mut rest)
            .unwrap();
        assert_eq!(rest, "typed after\n");
    }

    /// What is read comes through as asked; once the reader is dropped, nothing more
    /// is read: the next writing is there for whoever reads next. (Review: a read left
    /// pending after the session took the next line typed at the user's shell.)
    #[tokio::test]
    async fn reads_what_is_asked_and_nothing_once_dropped() {
        let (read_end, write_end) = std::io::pipe().unwrap();
        let read_end: &'static OwnedFd = Box::leak(Box::new(OwnedFd::from(read_end)));
        let mut write_end = write_end;
        let mut reader = StdinReader::start(read_end.as_fd()).unwrap();
        write_end.write_all(b"first line\n").unwrap();
        assert_eq!(reader.read(4).await.unwrap(), b"firs");
        assert_eq!(reader.read(64).await.unwrap(), b"t line\n");
        // Asked, nothing there yet: waits, then gets it.
        let pending = tokio::spawn(async move {
            let got = reader.read(64).await.unwrap();
            (reader, got)
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        write_end.write_all(b"second\n").unwrap();
        let (reader, got) = pending.await.unwrap();
        assert_eq!(got, b"second\n");
        drop(reader);
        assert_the_next_reader_gets_what_comes(read_end, write_end);
    }

    /// Dropped while it waits for input, the thread ends without reading.
    #[tokio::test]
    async fn a_reader_dropped_while_waiting_reads_nothing() {
        let (read_end, write_end) = std::io::pipe().unwrap();
        let read_end: &'static OwnedFd = Box::leak(Box::new(OwnedFd::from(read_end)));
        let mut reader = StdinReader::start(read_end.as_fd()).unwrap();
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(100), reader.read(64)).await;
        assert!(waiting.is_err(), "read with nothing there");
        drop(reader);
        assert_the_next_reader_gets_what_comes(read_end, write_end);
    }
}
