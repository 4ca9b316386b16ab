//! Redaction: the secret replaced in what the upstream sends back, so a server that
//! echoes the request (or quotes the credential in an error) cannot hand it to the
//! guest.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::timeout;

use super::{BoxError, ProxyBody};

/// How long redacted upgraded streams hold back bytes that might begin a secret
/// before sending them anyway (an interactive protocol must not stall on them).
pub(super) const HOLD_FLUSH: Duration = Duration::from_millis(100);
/// Secrets (or their credential part) shorter than this are not searched for in
/// responses: redacting every short string would mangle ordinary content. (`vmctl
/// secret set` refuses them; a secrets file edited by hand may still hold one.)
pub(super) const MIN_REDACTED_LEN: usize = crate::secrets::MIN_SECRET_LEN;

/// Copies `from` to `to` through `redactor`, then closes `to`'s sending side (after
/// a failure too: the other way goes on, and `to`'s reader must not wait forever).
/// Bytes held back because they might begin the secret are sent anyway after
/// [`HOLD_FLUSH`] without more data (see [`Redactor::flush_held`]: a pause inside the
/// secret does not let it through); after a failure they are dropped.
pub(super) async fn copy_redacted<R, W>(from: R, mut to: W, redactor: Redactor) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let copied = redact_until_end(from, &mut to, redactor).await;
    let _ = to.shutdown().await;
    copied
}

/// [`copy_redacted`]'s copy: the bytes it sent, once `from` ended.
pub(super) async fn redact_until_end<R, W>(
    mut from: R,
    to: &mut W,
    mut redactor: Redactor,
) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut sent = 0u64;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let read = if redactor.holding() {
            match timeout(HOLD_FLUSH, from.read(&mut buf)).await {
                Ok(read) => read?,
                Err(_) => {
                    let out = redactor.flush_held();
                    sent += send(to, unless_withdrawn(&redactor, out)?).await?;
                    continue;
                }
            }
        } else {
            from.read(&mut buf).await?
        };
        if read == 0 {
            let out = redactor.finish();
            return Ok(sent + send(to, unless_withdrawn(&redactor, out)?).await?);
        }
        let out = redactor.feed(&buf[..read]);
        sent += send(to, unless_withdrawn(&redactor, out)?).await?;
    }
}

/// `out`, unless the secret was withdrawn meanwhile: then the stream ends with an error
/// before `out` (which a probe decided) reaches the guest.
fn unless_withdrawn(redactor: &Redactor, out: Bytes) -> io::Result<Bytes> {
    if redactor.withdrawn() {
        return Err(io::Error::other(WITHDRAWN));
    }
    Ok(out)
}

const WITHDRAWN: &str = "the secret this stream carried was withdrawn after probes for it";
pub(super) const SECRET_GONE: &str =
    "the secret this stream carried is no longer bound to its host";

/// Writes and flushes `bytes`: the number sent.
pub(super) async fn send<W: AsyncWrite + Unpin>(to: &mut W, bytes: Bytes) -> io::Result<u64> {
    to.write_all(&bytes).await?;
    to.flush().await?;
    Ok(bytes.len() as u64)
}

/// How many suspected probes of a secret one proxy (one VM's run) takes before it no
/// longer sends that secret.
pub const PROBES_TOLERATED: u32 = 3;

/// Watches one secret for probes. Holding back or masking what might begin the secret
/// tells whoever chose the bytes a bound host sends back (a file the guest stored
/// there, an echo) whether they begin it: one guessed character at a time, the guest
/// could learn it all. So each time a long start of the secret, longer than its public
/// form (`sk-ant-api03-`, `Bearer `) and a few characters, ends without the whole
/// secret (the stream turned away from it, paused on it, or ended in it) counts as a
/// probe, the right guesses and the wrong alike; after [`PROBES_TOLERATED`], the
/// proxy stops sending the secret, and streams it redacts end at once. Ordinary
/// traffic never holds that much of a secret it does not contain. The count is kept
/// (in `record`, for this value of the secret) across the VM's runs: only a new
/// value, which a leak of a few characters calls for anyway, starts it again.
#[derive(Debug)]
pub struct Tripwire {
    secret: String,
    fingerprint: String,
    probes: AtomicU32,
    record: Option<PathBuf>,
    saving: std::sync::Mutex<()>,
}

/// A short digest of a secret's value: which value a count is of, and nothing of it.
fn fingerprint(value: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, value);
    digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a [`Tripwire`] keeps between runs.
#[derive(serde::Serialize, serde::Deserialize)]
struct ProbeRecord {
    /// Of the secret's value: a new value starts a new count.
    fingerprint: String,
    probes: u32,
}

impl Tripwire {
    /// The watch of the secret `name` of value `value`, its count read from `record`.
    pub(super) fn new(name: &str, value: &[u8], record: Option<PathBuf>) -> Self {
        let fingerprint = fingerprint(value);
        let kept = record
            .as_deref()
            .and_then(|path| std::fs::read(path).ok())
            .and_then(|text| serde_json::from_slice::<ProbeRecord>(&text).ok())
            .filter(|kept| kept.fingerprint == fingerprint)
            .map_or(0, |kept| kept.probes);
        Self {
            secret: name.to_owned(),
            fingerprint,
            probes: AtomicU32::new(kept),
            record,
            saving: std::sync::Mutex::new(()),
        }
    }

    /// Whether this watches the secret of value `value`.
    pub(super) fn watches(&self, value: &[u8]) -> bool {
        fingerprint(value) == self.fingerprint
    }

    /// The probes counted, for the fuzz harness.
    #[cfg(feature = "fuzzing")]
    pub(super) fn probes(&self) -> u32 {
        self.probes.load(Ordering::Relaxed)
    }

    /// Whether the secret is no longer sent.
    pub(super) fn tripped(&self) -> bool {
        self.probes.load(Ordering::Relaxed) >= PROBES_TOLERATED
    }

    fn save(&self) {
        let Some(path) = &self.record else { return };
        let _one_at_a_time = self.saving.lock().unwrap_or_else(|e| e.into_inner());
        let kept = ProbeRecord {
            fingerprint: self.fingerprint.clone(),
            probes: self.probes.load(Ordering::Relaxed),
        };
        let saved = serde_json::to_vec(&kept)
            .map_err(io::Error::other)
            .and_then(|text| crate::policy::write_atomically(path, &text, 0o600));
        if let Err(e) = saved {
            tracing::warn!(
                "cannot record the probes of secret {} in {}: {e}",
                self.secret,
                path.display()
            );
        }
    }

    fn probe(&self) {
        let seen = self.probes.fetch_add(1, Ordering::Relaxed) + 1;
        self.save();
        if seen == PROBES_TOLERATED {
            tracing::error!(
                "vmctl: the egress proxy withdrew secret {}: {seen} responses of its hosts \
                 held a long start of it without the rest, as when the guest probes for it \
                 a character at a time; it is not sent again until it is set anew (`vmctl \
                 secret set`: a new value, as a few characters may have leaked) or the VM \
                 is removed",
                self.secret
            );
        } else if seen < PROBES_TOLERATED {
            tracing::warn!(
                "vmctl: a response held a long start of secret {} without the rest \
                 ({seen} of {PROBES_TOLERATED} before it is withdrawn)",
                self.secret
            );
        }
    }
}

/// The length from which a start of `needle` counts as a probe: up to the secret's own
/// characters past its public form (a known token prefix such as `sk-ant-api03-`, see
/// [`crate::secrets::public_form_len`]), and four more; [`MIN_REDACTED_LEN`] at least.
/// For a needle that holds the secret base64-encoded (HTTP Basic's, whose start is the
/// same for every token), from the encoded character that completes those bytes: a
/// start of the encoding tells as much of the secret as its decoding holds. For a needle
/// whose secret cannot be placed, from [`MIN_REDACTED_LEN`]: a guess that can be told
/// apart from ordinary text may be one, and counting it too soon only costs a probe.
fn probe_len(needle: &[u8], secret: &[u8]) -> usize {
    let told = |at: usize| at + crate::secrets::public_form_len(secret) + 4;
    let least = match placement(needle, secret) {
        Some(Placement::Plain { at }) => told(at),
        // Each 4 encoded characters carry 3 bytes; a partial group gives away the
        // high bits of the next byte, so count from the character that completes them.
        Some(Placement::Base64 { word, at }) => word + (told(at) * 4).div_ceil(3),
        None => MIN_REDACTED_LEN,
    };
    least.clamp(MIN_REDACTED_LEN, needle.len())
}

/// Where a needle holds the secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// As is, from byte `at`.
    Plain { at: usize },
    /// Base64-encoded in the needle's last word, which starts at byte `word`; its
    /// decoding holds the secret from byte `at` (`x-access-token:` before a token in
    /// git's Basic credential).
    Base64 { word: usize, at: usize },
}

/// Base64 as credentials use it (Basic's standard alphabet, or the URL-safe one),
/// padded or not.
const CREDENTIAL_BASE64: [base64::engine::GeneralPurpose; 2] = {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let config =
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    [
        GeneralPurpose::new(&base64::alphabet::STANDARD, config),
        GeneralPurpose::new(&base64::alphabet::URL_SAFE, config),
    ]
};

/// Where `needle` holds `secret`, found rather than assumed from the header's form, so
/// a template or encoding added later is placed too (or, when it cannot be, counted
/// conservatively by [`probe_len`]).
fn placement(needle: &[u8], secret: &[u8]) -> Option<Placement> {
    use base64::Engine;
    if let Some(at) = find(needle, secret) {
        return Some(Placement::Plain { at });
    }
    let word = needle
        .iter()
        .rposition(|b| *b == b' ')
        .map_or(0, |space| space + 1);
    CREDENTIAL_BASE64.iter().find_map(|engine| {
        // The decoding holds the secret: wiped when dropped, as the needles are.
        let decoded = zeroize::Zeroizing::new(engine.decode(&needle[word..]).ok()?);
        let at = find(&decoded, secret)?;
        Some(Placement::Base64 { word, at })
    })
}

/// Replaces the secret in what the upstream sends back, so a server that echoes
/// the request (or quotes the credential in an error) cannot hand it to the guest.
/// Replacements keep the length, so Content-Length and framing stay right.
#[derive(Clone)]
pub(super) struct Redactor {
    /// The whole header value and its credential part, longest first.
    /// Copies of the secret: wiped when the last redactor of a request goes.
    pub(super) needles: Arc<[zeroize::Zeroizing<Vec<u8>>]>,
    /// For each needle, the length from which a start of it is a probe ([`probe_len`]).
    pub(super) probe_lens: Arc<[usize]>,
    /// Told of every suspected probe (see [`Tripwire`]).
    pub(super) tripwire: Option<Arc<Tripwire>>,
    /// Whether the start `carried` holds was counted already (by a pause's flush).
    pub(super) carried_counted: bool,
    /// The end of the data seen so far when it might begin a needle.
    pub(super) held: Vec<u8>,
    /// Bytes already sent (by [`Redactor::flush_held`]) that might begin a needle:
    /// matched against with what comes next, so the rest of the needle is redacted.
    pub(super) carried: Vec<u8>,
}

impl Redactor {
    /// Redacts the header `value` that carries `secret`, its last word when that holds
    /// the secret (as is or encoded), and `secret` itself (which a header template may
    /// wrap in other text).
    pub(super) fn for_secret(value: &[u8], secret: &[u8]) -> Option<Self> {
        let secret_copy = |bytes: &[u8]| zeroize::Zeroizing::new(bytes.to_vec());
        let mut needles = vec![secret_copy(value), secret_copy(secret)];
        // "Basic <base64>": the encoded credential alone is as secret as the whole
        // value. A last word without the secret is a template's text
        // (`{} Secure-Session`): ordinary pages may begin it, and those are no probes.
        if let Some(space) = value.iter().rposition(|b| *b == b' ') {
            let word = &value[space + 1..];
            if placement(word, secret).is_some() {
                needles.push(secret_copy(word));
            }
        }
        needles.retain(|needle| needle.len() >= MIN_REDACTED_LEN);
        needles.sort_by_key(|needle| std::cmp::Reverse(needle.len()));
        needles.dedup();
        let probe_lens: Vec<usize> = needles
            .iter()
            .map(|needle| probe_len(needle, secret))
            .collect();
        (!needles.is_empty()).then(|| Self {
            needles: needles.into(),
            probe_lens: probe_lens.into(),
            tripwire: None,
            carried_counted: false,
            held: Vec::new(),
            carried: Vec::new(),
        })
    }

    /// Whether the secret was withdrawn (see [`Tripwire`]): the stream must end now,
    /// before what was just fed or flushed reaches the guest.
    pub(super) fn withdrawn(&self) -> bool {
        self.tripwire.as_ref().is_some_and(|t| t.tripped())
    }

    /// The name of the secret it redacts, as its tripwire knows it.
    pub(super) fn secret_name(&self) -> Option<&str> {
        self.tripwire
            .as_deref()
            .map(|tripwire| tripwire.secret.as_str())
    }

    /// Whether `value` is the header value this redactor was made for.
    pub(super) fn redacts_value(&self, value: &[u8]) -> bool {
        self.needles.iter().any(|needle| needle.as_slice() == value)
    }

    /// The same, telling `tripwire` of suspected probes.
    pub(super) fn watched_by(mut self, tripwire: Arc<Tripwire>) -> Self {
        self.tripwire = Some(tripwire);
        self
    }

    /// Whether `start`, a start of a needle the stream held, is long enough to be a
    /// probe when it ends without the rest.
    fn probing(&self, start: &[u8]) -> bool {
        self.needles
            .iter()
            .zip(self.probe_lens.iter())
            .any(|(needle, &least)| start.len() >= least && needle.starts_with(start))
    }

    /// Whether `window` holds a long start of a needle ([`probe_len`]) followed by a
    /// byte that does not go on with it. (Whether such a start comes back masked or
    /// not, held back or not, is what a probe asks; so the wrong guesses count too,
    /// wherever the stream's chunks fall.)
    fn turns_away_from_a_long_start(&self, window: &[u8], from: usize) -> bool {
        self.needles
            .iter()
            .zip(self.probe_lens.iter())
            .any(|(needle, &least)| {
                (from..window.len().saturating_sub(least)).any(|at| {
                    let rest = &window[at..];
                    let matched = rest
                        .iter()
                        .zip(needle.iter())
                        .take_while(|(a, b)| a == b)
                        .count();
                    matched >= least && matched < needle.len() && matched < rest.len()
                })
            })
    }

    fn count_probe(&self) {
        if let Some(tripwire) = &self.tripwire {
            tripwire.probe();
        }
    }

    /// The part of the stream up to `chunk` that is safe to pass on now.
    pub(super) fn feed(&mut self, chunk: &[u8]) -> Bytes {
        // [already sent | held | chunk], searched as one.
        let mut window = std::mem::take(&mut self.carried);
        let sent = window.len();
        window.append(&mut self.held);
        window.extend_from_slice(chunk);
        // A start already counted when a pause flushed it is not counted again.
        let from = if self.carried_counted { sent } else { 0 };
        if self.tripwire.is_some() && self.turns_away_from_a_long_start(&window, from) {
            self.count_probe();
        }
        self.redact(&mut window);
        let keep = self.prefix_at_end(&window);
        let hold = keep.min(window.len() - sent);
        self.held = window.split_off(window.len() - hold);
        // A possible needle start reaching back into sent bytes (then nothing is
        // left to send) stays carried.
        self.carried = if keep > hold {
            window[sent - (keep - hold)..sent].to_vec()
        } else {
            Vec::new()
        };
        self.carried_counted &= !self.carried.is_empty();
        Bytes::from(window.split_off(sent))
    }

    /// For a stream that must not stall: sends the held bytes now. They might begin a
    /// needle, so they are masked when long enough to carry a secret's own characters
    /// ([`MIN_REDACTED_LEN`]; shorter starts are too short to say anything, and
    /// masking them would mangle ordinary text), and remembered, so the rest of a
    /// needle they begin is still redacted when it comes.
    pub(super) fn flush_held(&mut self) -> Bytes {
        let held = std::mem::take(&mut self.held);
        let started = self.carried.len() + held.len();
        if !held.is_empty() && self.probing(&[self.carried.as_slice(), &held].concat()) {
            self.count_probe();
            self.carried_counted = true;
        }
        let out = if started >= MIN_REDACTED_LEN {
            vec![b'*'; held.len()]
        } else {
            held.clone()
        };
        self.carried.extend_from_slice(&held);
        Bytes::from(out)
    }

    /// Whatever was held back, at the end of the stream: masked, as
    /// [`Redactor::flush_held`] masks, when it might be most of a needle (a stream
    /// that ends one byte short of the secret must not deliver the rest of it).
    pub(super) fn finish(&mut self) -> Bytes {
        let rest = self.flush_held();
        self.carried.clear();
        rest
    }

    pub(super) fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    pub(super) fn redact(&self, data: &mut [u8]) {
        for needle in self.needles.iter() {
            let mut at = 0;
            while let Some(found) = find(&data[at..], needle) {
                let start = at + found;
                data[start..start + needle.len()].copy_from_slice(&replacement(needle.len()));
                at = start + needle.len();
            }
        }
    }

    /// The length of the longest end of `data` that is a proper prefix of a needle:
    /// the bytes that must wait for the next chunk.
    pub(super) fn prefix_at_end(&self, data: &[u8]) -> usize {
        let mut longest = 0;
        for needle in self.needles.iter() {
            let max = (needle.len() - 1).min(data.len());
            if let Some(k) = (longest + 1..=max)
                .rev()
                .find(|k| data.ends_with(&needle[..*k]))
            {
                longest = k;
            }
        }
        longest
    }

    pub(super) fn redact_headers(&self, headers: &mut HeaderMap) {
        for value in headers.values_mut() {
            let mut bytes = value.as_bytes().to_vec();
            self.redact(&mut bytes);
            if bytes != value.as_bytes() {
                // The replacement is visible ASCII, so the value stays valid.
                *value = HeaderValue::from_bytes(&bytes)
                    .unwrap_or_else(|_| HeaderValue::from_static("[REDACTED]"));
            }
        }
    }
}

pub(super) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// `[REDACTED]` padded with `*` to `len` bytes (or just `*`s if shorter).
pub(super) fn replacement(len: usize) -> Vec<u8> {
    const MARKER: &[u8] = b"[REDACTED]";
    let mut out = if len >= MARKER.len() {
        MARKER.to_vec()
    } else {
        Vec::new()
    };
    out.resize(len, b'*');
    out
}

/// A response body streamed through a [`Redactor`], chunk by chunk. Bytes held back
/// because they might begin the secret go on after [`HOLD_FLUSH`] without more of the
/// body, as [`copy_redacted`] sends them: a stream that pauses there (a progress line,
/// a long poll) must not wait for its next chunk.
pub(super) struct RedactedBody {
    pub(super) inner: ProxyBody,
    pub(super) redactor: Redactor,
    pub(super) trailers: Option<HeaderMap>,
    pub(super) done: bool,
    /// Runs while held bytes wait for the body's next frame.
    held_since: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl RedactedBody {
    pub(super) fn new(inner: ProxyBody, redactor: Redactor) -> Self {
        Self {
            inner,
            redactor,
            trailers: None,
            done: false,
            held_since: None,
        }
    }

    /// Ends the body with the error `why`, nothing more after it (trailers neither).
    fn end_with(&mut self, why: &'static str) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        self.trailers = None;
        Poll::Ready(Some(Err(why.into())))
    }
}

impl Body for RedactedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            let polled = Pin::new(&mut this.inner).poll_frame(cx);
            if polled.is_pending() && this.redactor.holding() {
                let held_since = this
                    .held_since
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(HOLD_FLUSH)));
                ready!(std::future::Future::poll(held_since.as_mut(), cx));
                this.held_since = None;
                let held = this.redactor.flush_held();
                if this.redactor.withdrawn() {
                    return this.end_with(WITHDRAWN);
                }
                return Poll::Ready(Some(Ok(Frame::data(held))));
            }
            this.held_since = None;
            let frame = match ready!(polled) {
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    this.done = true;
                    let rest = this.redactor.finish();
                    if this.redactor.withdrawn() {
                        return this.end_with(WITHDRAWN);
                    }
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    continue;
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    let safe = this.redactor.feed(&data);
                    if this.redactor.withdrawn() {
                        return this.end_with(WITHDRAWN);
                    }
                    if !safe.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(safe))));
                    }
                }
                Err(frame) => {
                    if let Ok(mut trailers) = frame.into_trailers() {
                        this.redactor.redact_headers(&mut trailers);
                        this.trailers = Some(trailers);
                    }
                    // Trailers end the body: send what was held, then them.
                    this.done = true;
                    let rest = this.redactor.finish();
                    if this.redactor.withdrawn() {
                        return this.end_with(WITHDRAWN);
                    }
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Replacements keep lengths: what is left is the inner rest plus what is held.
        let inner = self.inner.size_hint();
        let held = self.redactor.held.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}
