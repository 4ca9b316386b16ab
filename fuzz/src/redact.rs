//! An upstream that sends back what the guest chose (an echo of its request, a file
//! it stored there), in chunks and pauses of its choosing, to a request that carried a
//! secret: the egress proxy's response redaction
//! ([`egress::proxy::fuzzing::ResponseRedaction`]) must keep the secret from the
//! guest, whatever the bytes and wherever the stream is cut.
//!
//! Besides not panicking, every run checks what reached the guest:
//! - it holds no whole needle: the header value, the secret, or the base64 word of
//!   git's Basic credential;
//! - of each place the stream held the secret, fewer than
//!   [`egress::secrets::MIN_SECRET_LEN`] bytes came through unmasked (a pause may send
//!   a start of it shorter than that, which says nothing). A place that overlaps
//!   another needle's place without lying inside it is left out: copies of a needle
//!   do not overlap, so the bytes of one such place that the other does not cover
//!   are the sender's own (which the guest chose: a secret whose end begins it
//!   again, `abcab`, is there again where bytes after a copy complete it), and one
//!   of the two is masked (no whole needle reaches the guest);
//! - it is as long as what the upstream sent, unless the secret was withdrawn;
//! - a stream that never paused reached the guest unchanged outside the places that
//!   held a needle (redaction mangles nothing else);
//! - a stream that never held the first [`egress::secrets::MIN_SECRET_LEN`] bytes of
//!   a needle counted no probe of the secret.
//!
//! The secret is drawn from lower-case letters, digits, `-`, `_` and `.`, and
//! templates from printable characters other than those of the mask (`[REDACTED]`,
//! `*`), so a byte that reached the guest equal to what the upstream sent came through
//! unmasked.

use base64::Engine;
use egress::proxy::fuzzing::ResponseRedaction;
use egress::secrets::MIN_SECRET_LEN;

use crate::input::{Reader, Writer};

/// The secret's characters: a token's (`sk-ant-api03-...`, a JWT's dots), but the
/// masks'.
pub const SECRET_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-_.";
/// The characters of the masks the redaction writes.
const MASK_CHARACTERS: &[u8] = b"[]*REDACT";
/// The longest secret an input makes.
pub const MAX_SECRET_LEN: usize = 64;
/// The longest template prefix or suffix an input makes.
pub const MAX_TEMPLATE_PART: usize = 16;
/// The most operations one input runs.
pub const MAX_STREAM_OPS: usize = 256;

/// How the request carried the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Form {
    /// The header value is the secret (`x-api-key`).
    Bare,
    /// `Bearer <secret>`.
    Bearer,
    /// `Basic base64("x-access-token:" + secret)`, as git sends it to GitHub.
    GitBasic,
    /// A `--header` template: `<prefix><secret><suffix>`.
    Template { prefix: Vec<u8>, suffix: Vec<u8> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Bytes of any value for the stream.
    Bytes(Vec<u8>),
    /// Bytes `from..to` of a needle ([`Input::needles`], by index) for the stream:
    /// the whole needle, or a start or an end of it.
    Piece { needle: u8, from: u8, to: u8 },
    /// The upstream's bytes so far arrive, as one chunk.
    Chunk,
    /// The bytes so far arrive, then the upstream pauses (what was held back goes).
    Pause,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    pub form: Form,
    /// Whether the secret is watched for probes.
    pub watched: bool,
    /// Of [`SECRET_ALPHABET`], [`MIN_SECRET_LEN`] to [`MAX_SECRET_LEN`] long.
    pub secret: Vec<u8>,
    pub ops: Vec<Op>,
}

/// The printable characters but the masks', which templates are drawn from.
fn template_alphabet() -> Vec<u8> {
    (b' '..=b'~')
        .filter(|c| !MASK_CHARACTERS.contains(c))
        .collect()
}

fn pick(alphabet: &[u8], choice: u8) -> u8 {
    alphabet[usize::from(choice) % alphabet.len()]
}

fn index_in(alphabet: &[u8], c: u8) -> u8 {
    alphabet.iter().position(|a| *a == c).unwrap_or(0) as u8
}

impl Op {
    fn read(r: &mut Reader) -> Op {
        match r.u8() % 4 {
            0 => {
                let len = usize::from(r.u8());
                Op::Bytes(r.bytes(len).to_vec())
            }
            1 => Op::Piece {
                needle: r.u8(),
                from: r.u8(),
                to: r.u8(),
            },
            2 => Op::Chunk,
            _ => Op::Pause,
        }
    }

    fn write(&self, w: &mut Writer) {
        match self {
            Op::Bytes(bytes) => w.u8(0).u8(bytes.len() as u8).bytes(bytes),
            Op::Piece { needle, from, to } => w.u8(1).u8(*needle).u8(*from).u8(*to),
            Op::Chunk => w.u8(2),
            Op::Pause => w.u8(3),
        };
    }
}

impl Input {
    pub fn decode(data: &[u8]) -> Input {
        let mut r = Reader::new(data);
        let flags = r.u8();
        let secret_len =
            MIN_SECRET_LEN + usize::from(r.u8()) % (MAX_SECRET_LEN - MIN_SECRET_LEN + 1);
        let secret = (0..secret_len)
            .map(|_| pick(SECRET_ALPHABET, r.u8()))
            .collect();
        let form = match flags % 4 {
            0 => Form::Bare,
            1 => Form::Bearer,
            2 => Form::GitBasic,
            _ => {
                let alphabet = template_alphabet();
                let part = |r: &mut Reader| {
                    let len = usize::from(r.u8()) % (MAX_TEMPLATE_PART + 1);
                    (0..len).map(|_| pick(&alphabet, r.u8())).collect()
                };
                Form::Template {
                    prefix: part(&mut r),
                    suffix: part(&mut r),
                }
            }
        };
        let mut ops = Vec::new();
        while !r.is_empty() && ops.len() < MAX_STREAM_OPS {
            ops.push(Op::read(&mut r));
        }
        Input {
            form,
            watched: flags & 4 != 0,
            secret,
            ops,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let form = match self.form {
            Form::Bare => 0,
            Form::Bearer => 1,
            Form::GitBasic => 2,
            Form::Template { .. } => 3,
        };
        w.u8(form | if self.watched { 4 } else { 0 });
        w.u8((self.secret.len() - MIN_SECRET_LEN) as u8);
        for c in &self.secret {
            w.u8(index_in(SECRET_ALPHABET, *c));
        }
        if let Form::Template { prefix, suffix } = &self.form {
            let alphabet = template_alphabet();
            for part in [prefix, suffix] {
                w.u8(part.len() as u8);
                for c in part {
                    w.u8(index_in(&alphabet, *c));
                }
            }
        }
        for op in &self.ops {
            op.write(&mut w);
        }
        w.data
    }

    /// The header value the request carried the secret in.
    pub fn header_value(&self) -> Vec<u8> {
        match &self.form {
            Form::Bare => self.secret.clone(),
            Form::Bearer => [b"Bearer ".as_slice(), &self.secret].concat(),
            Form::GitBasic => {
                let credentials = [b"x-access-token:".as_slice(), &self.secret].concat();
                let encoded = base64::engine::general_purpose::STANDARD.encode(credentials);
                [b"Basic ", encoded.as_bytes()].concat()
            }
            Form::Template { prefix, suffix } => [prefix.as_slice(), &self.secret, suffix].concat(),
        }
    }

    /// What must never reach the guest whole: the header value, the secret, and the
    /// value's last word (git's encoded credential; a template's word around the
    /// secret, or its text after it, which need not be a needle).
    pub fn needles(&self) -> Vec<Vec<u8>> {
        let value = self.header_value();
        let last_word = match value.iter().rposition(|c| *c == b' ') {
            Some(space) => value[space + 1..].to_vec(),
            None => value.clone(),
        };
        vec![value, self.secret.clone(), last_word]
    }
}

/// What one run sent to the guest, and of what stream.
#[derive(Debug, Default)]
pub struct Outcome {
    /// What the upstream sent, whole.
    pub stream: Vec<u8>,
    /// What reached the guest, whole.
    pub sent: Vec<u8>,
    /// Whether the upstream paused anywhere.
    pub paused: bool,
    /// Whether the secret was withdrawn (the stream ended there).
    pub withdrawn: bool,
    /// The probes of the secret counted.
    pub probes: u32,
}

/// The fuzz target: any bytes.
pub fn run(data: &[u8]) {
    let input = Input::decode(data);
    check(&input, &run_input(&input));
}

/// Streams `input`'s bytes through the redaction as its operations say, as the proxy
/// does: what a call returns reaches the guest unless the secret was withdrawn by it.
pub fn run_input(input: &Input) -> Outcome {
    let needles = input.needles();
    let mut redaction = ResponseRedaction::new(&input.header_value(), &input.secret, input.watched)
        .expect("a secret of at least MIN_SECRET_LEN bytes is redacted");
    let mut outcome = Outcome::default();
    let mut pending = Vec::new();
    for op in &input.ops {
        let out = match op {
            Op::Bytes(bytes) => {
                pending.extend_from_slice(bytes);
                continue;
            }
            Op::Piece { needle, from, to } => {
                let needle = &needles[usize::from(*needle) % needles.len()];
                let from = usize::from(*from).min(needle.len());
                let to = usize::from(*to).clamp(from, needle.len());
                pending.extend_from_slice(&needle[from..to]);
                continue;
            }
            Op::Chunk => arrive(&mut pending, &mut outcome.stream, &mut redaction),
            Op::Pause => {
                outcome.paused = true;
                let mut out = arrive(&mut pending, &mut outcome.stream, &mut redaction);
                if !redaction.withdrawn() {
                    out.extend(redaction.pause());
                }
                out
            }
        };
        if redaction.withdrawn() {
            break;
        }
        outcome.sent.extend(out);
    }
    if !redaction.withdrawn() {
        let mut out = arrive(&mut pending, &mut outcome.stream, &mut redaction);
        if !redaction.withdrawn() {
            out.extend(redaction.finish());
        }
        if !redaction.withdrawn() {
            outcome.sent.extend(out);
        }
    }
    outcome.withdrawn = redaction.withdrawn();
    outcome.probes = redaction.probes();
    outcome
}

/// `pending` arrives from the upstream: what of the stream goes to the guest now.
fn arrive(
    pending: &mut Vec<u8>,
    stream: &mut Vec<u8>,
    redaction: &mut ResponseRedaction,
) -> Vec<u8> {
    stream.extend_from_slice(pending);
    redaction.feed(&std::mem::take(pending))
}

/// Where `needle` starts in `haystack`, overlapping places included.
fn places(haystack: &[u8], needle: &[u8]) -> Vec<usize> {
    if needle.is_empty() || needle.len() > haystack.len() {
        return Vec::new();
    }
    haystack
        .windows(needle.len())
        .enumerate()
        .filter(|(_, window)| *window == needle)
        .map(|(at, _)| at)
        .collect()
}

/// Panics, saying which, when what reached the guest breaks one of the module's
/// rules.
pub fn check(input: &Input, outcome: &Outcome) {
    let Outcome {
        stream,
        sent,
        paused,
        withdrawn,
        probes,
    } = outcome;
    let shown = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    if *withdrawn {
        assert!(
            sent.len() <= stream.len(),
            "more reached the guest than was sent"
        );
    } else {
        assert_eq!(
            sent.len(),
            stream.len(),
            "the redaction changed the stream's length"
        );
    }
    let needles = input.needles();
    let encoded_word = matches!(input.form, Form::GitBasic).then(|| &needles[2]);
    let masked: Vec<&Vec<u8>> = needles[..2].iter().chain(encoded_word).collect();
    for needle in &masked {
        assert!(
            places(sent, needle).is_empty(),
            "needle {:?} reached the guest: {:?}",
            shown(needle),
            shown(sent)
        );
    }
    let spans: Vec<(usize, usize)> = masked
        .iter()
        .flat_map(|needle| {
            places(stream, needle)
                .into_iter()
                .map(|at| (at, at + needle.len()))
        })
        .collect();
    let len = input.secret.len();
    let overlaps_another = |at: usize| {
        spans.iter().any(|&(start, end)| {
            let overlaps = start < at + len && at < end;
            let holds_it = start <= at && at + len <= end;
            overlaps && !holds_it
        })
    };
    for at in places(stream, &input.secret)
        .into_iter()
        .filter(|at| !overlaps_another(*at))
    {
        let end = (at + len).min(sent.len());
        let unmasked = (at..end).filter(|j| sent[*j] == stream[*j]).count();
        assert!(
            unmasked < MIN_SECRET_LEN,
            "{unmasked} bytes of the secret at {at} reached the guest unmasked: {:?}",
            shown(&sent[at.min(sent.len())..end])
        );
    }
    if !paused && !withdrawn {
        // The stream's end too, where it is a start of a needle: the end masks that
        // when it is long ("one byte short of the secret").
        let mut in_a_needle = vec![false; stream.len()];
        for needle in &needles {
            for at in places(stream, needle) {
                in_a_needle[at..at + needle.len()].fill(true);
            }
            if let Some(start) = (1..needle.len())
                .rev()
                .find(|k| stream.ends_with(&needle[..*k]))
            {
                in_a_needle[stream.len() - start..].fill(true);
            }
        }
        if let Some(j) = (0..stream.len()).find(|j| !in_a_needle[*j] && sent[*j] != stream[*j]) {
            panic!(
                "byte {j} of a stream that never paused was changed outside every needle: \
                 {:?} became {:?}",
                shown(stream),
                shown(sent)
            );
        }
    }
    let starts: Vec<&[u8]> = needles
        .iter()
        .filter(|needle| needle.len() >= MIN_SECRET_LEN)
        .map(|needle| &needle[..MIN_SECRET_LEN])
        .collect();
    if starts.iter().all(|start| places(stream, start).is_empty()) {
        assert_eq!(
            *probes,
            0,
            "probes counted in a stream that never held a needle's start: {:?}",
            shown(stream)
        );
    }
}
