//! Compressed responses from a host with a secret, decoded before redaction, and
//! transfer codings besides chunked, decoded for every response.
//!
//! The proxy asks a host with a secret for `Accept-Encoding: identity`, but a server
//! may compress anyway, and a compressed echo of the request would carry the secret
//! past the search for it. So a gzip or deflate body is decoded (and goes to the guest
//! uncompressed); a body in any other coding is refused, as it cannot be searched.
//!
//! A transfer coding (`Transfer-Encoding: gzip, chunked`) belongs to one hop, and the
//! guest's hop is hyper's, which frames the body anew and sends no such header: the
//! proxy undoes gzip and deflate, and refuses others, rather than pass on coded bytes
//! that nothing names.

use std::io::{self, Write};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use flate2::write::{DeflateDecoder, MultiGzDecoder, ZlibDecoder};
use http::header::{self, HeaderMap, HeaderValue};
use hyper::body::{Body, Frame, Incoming};

use super::headers::{ends_in_chunked, list_tokens};
use super::BoxError;

/// Decoded output is handed on once it reaches this size. One decoder step adds at
/// most its 32 KiB buffer, so a body that expands a thousandfold (a "zip bomb") is
/// still held a frame at a time.
const FRAME_BYTES: usize = 64 * 1024;

/// What a coding header's value that is not text (bytes past ASCII) counts as: a
/// coding the proxy cannot undo, so that a body it names is refused, not passed on
/// unsearched or coded.
const UNREADABLE_CODING: &str = "(not text)";

/// The content codings (`Content-Encoding`), which the response's recipient undoes.
pub(super) fn content_codings(headers: &HeaderMap) -> Vec<String> {
    let mut codings = codings_named(list_tokens(headers, header::CONTENT_ENCODING));
    codings.extend(unreadable(headers, header::CONTENT_ENCODING));
    codings
}

/// [`UNREADABLE_CODING`] when a `name` header's value is not text.
fn unreadable(headers: &HeaderMap, name: header::HeaderName) -> Option<String> {
    let unreadable = headers
        .get_all(name)
        .iter()
        .any(|value| value.to_str().is_err());
    unreadable.then(|| UNREADABLE_CODING.to_string())
}

/// The transfer codings under a final `chunked` (RFC 9112, 6.1), or all of them when
/// the body is read to the connection's close: this hop's, which the proxy undoes, as
/// the `Transfer-Encoding` header naming them does not go on to the guest.
pub(super) fn transfer_codings(headers: &HeaderMap) -> Vec<String> {
    let mut transfer: Vec<&str> = list_tokens(headers, header::TRANSFER_ENCODING).collect();
    if ends_in_chunked(headers) {
        transfer.pop();
    }
    let mut codings = codings_named(transfer.into_iter());
    codings.extend(unreadable(headers, header::TRANSFER_ENCODING));
    codings
}

fn codings_named<'a>(listed: impl Iterator<Item = &'a str>) -> Vec<String> {
    listed
        .filter(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case("identity"))
        .map(str::to_ascii_lowercase)
        .collect()
}

/// A coding the proxy can undo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Coding {
    Gzip,
    /// RFC 9110's `deflate`: a zlib stream, or raw deflate (as some servers send it).
    Deflate,
}

/// What the proxy does with a body coded `codings`: nothing (`None`), decode it, or
/// refuse it (`Err`, the codings as the response named them).
pub(super) fn decoding_for(codings: &[String]) -> Result<Option<Coding>, String> {
    match codings {
        [] => Ok(None),
        [one] if one == "gzip" || one == "x-gzip" => Ok(Some(Coding::Gzip)),
        [one] if one == "deflate" => Ok(Some(Coding::Deflate)),
        _ => Err(codings.join(", ")),
    }
}

/// Makes the headers fit a body decoded from `Content-Encoding`: no coding, no
/// length (the decoded one is not known before the end), and a strong validator
/// made weak, since it named the coded bytes.
pub(super) fn headers_for_decoded(headers: &mut HeaderMap) {
    headers.remove(header::CONTENT_ENCODING);
    headers.remove(header::CONTENT_LENGTH);
    if let Some(etag) = headers.get(header::ETAG) {
        let weak = [b"W/".as_slice(), etag.as_bytes()].concat();
        if !etag.as_bytes().starts_with(b"W/") {
            match HeaderValue::from_bytes(&weak) {
                Ok(weak) => headers.insert(header::ETAG, weak),
                Err(_) => headers.remove(header::ETAG),
            };
        }
    }
}

enum Decoder {
    Gzip(MultiGzDecoder<Vec<u8>>),
    Zlib(ZlibDecoder<Vec<u8>>),
    RawDeflate(DeflateDecoder<Vec<u8>>),
    /// `deflate` before its first two bytes, which tell a zlib stream from raw
    /// deflate (as browsers tell them).
    DeflateStart(Vec<u8>),
}

/// Whether `start` begins a zlib stream (RFC 1950: method 8, a window of at most
/// 32 KiB, and a header check that makes the first 16 bits a multiple of 31).
fn is_zlib_start(start: [u8; 2]) -> bool {
    start[0] & 0x0f == 8 && start[0] >> 4 <= 7 && u16::from_be_bytes(start).is_multiple_of(31)
}

impl Decoder {
    fn new(coding: Coding) -> Self {
        match coding {
            Coding::Gzip => Self::Gzip(MultiGzDecoder::new(Vec::new())),
            Coding::Deflate => Self::DeflateStart(Vec::with_capacity(2)),
        }
    }

    /// Decodes from the start of `input`; how much of it was taken (0 once the
    /// stream has ended).
    fn write(&mut self, input: &[u8]) -> io::Result<usize> {
        if let Self::DeflateStart(start) = self {
            let taken = input.len().min(2 - start.len());
            start.extend_from_slice(&input[..taken]);
            if let Ok(first) = <[u8; 2]>::try_from(start.as_slice()) {
                *self = if is_zlib_start(first) {
                    Self::Zlib(ZlibDecoder::new(Vec::new()))
                } else {
                    Self::RawDeflate(DeflateDecoder::new(Vec::new()))
                };
                self.write_all(&first)?;
            }
            return Ok(taken);
        }
        let taken = match self {
            Self::Gzip(decoder) => decoder.write(input)?,
            Self::Zlib(decoder) => decoder.write(input)?,
            Self::RawDeflate(decoder) => decoder.write(input)?,
            Self::DeflateStart(_) => 0,
        };
        // The decoder buffers its output until the next write; it is wanted now.
        match self {
            Self::Gzip(decoder) => decoder.flush()?,
            Self::Zlib(decoder) => decoder.flush()?,
            Self::RawDeflate(decoder) => decoder.flush()?,
            Self::DeflateStart(_) => {}
        }
        Ok(taken)
    }

    fn write_all(&mut self, mut input: &[u8]) -> io::Result<()> {
        while !input.is_empty() {
            match self.write(input)? {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                taken => input = &input[taken..],
            }
        }
        Ok(())
    }

    /// Checks that the stream ended whole (its checksum included).
    fn finish(&mut self) -> io::Result<()> {
        match self {
            Self::Gzip(decoder) => decoder.try_finish(),
            Self::Zlib(decoder) => decoder.try_finish(),
            Self::RawDeflate(decoder) => decoder.try_finish(),
            Self::DeflateStart(_) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the deflate stream ends in its first byte",
            )),
        }
    }

    fn take_output(&mut self) -> Bytes {
        let output = match self {
            Self::Gzip(decoder) => decoder.get_mut(),
            Self::Zlib(decoder) => decoder.get_mut(),
            Self::RawDeflate(decoder) => decoder.get_mut(),
            Self::DeflateStart(_) => return Bytes::new(),
        };
        Bytes::from(std::mem::take(output))
    }
}

/// An upstream body decoded from gzip or deflate, frame by frame, trailers kept.
pub(super) struct DecodedBody<B = Incoming> {
    inner: B,
    decoder: Decoder,
    /// Coded bytes received and not yet decoded.
    pending: Bytes,
    /// Whether any coded byte came: an empty body (a HEAD's, a 304's) is no stream.
    coded_bytes_seen: bool,
    inner_done: bool,
    trailers: Option<HeaderMap>,
    done: bool,
}

impl<B> DecodedBody<B> {
    pub(super) fn new(inner: B, coding: Coding) -> Self {
        Self {
            inner,
            decoder: Decoder::new(coding),
            pending: Bytes::new(),
            coded_bytes_seen: false,
            inner_done: false,
            trailers: None,
            done: false,
        }
    }

    /// Decodes pending bytes until a frame's worth is out or none are left.
    fn decode_pending(&mut self) -> io::Result<Bytes> {
        let mut out = Vec::new();
        while !self.pending.is_empty() && out.len() < FRAME_BYTES {
            let taken = self.decoder.write(&self.pending)?;
            if taken == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bytes follow the end of the compressed stream",
                ));
            }
            self.pending.advance(taken);
            out.extend_from_slice(&self.decoder.take_output());
        }
        Ok(Bytes::from(out))
    }

    fn finish(&mut self) -> io::Result<Bytes> {
        if !self.coded_bytes_seen {
            return Ok(Bytes::new());
        }
        self.decoder.finish()?;
        Ok(self.decoder.take_output())
    }

    fn fail(&mut self, e: io::Error) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        self.trailers = None;
        let why = format!("the upstream's compressed response cannot be decoded: {e}");
        Poll::Ready(Some(Err(why.into())))
    }
}

impl<B> Body for DecodedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
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
            if !this.pending.is_empty() {
                match this.decode_pending() {
                    Ok(out) if !out.is_empty() => return Poll::Ready(Some(Ok(Frame::data(out)))),
                    Ok(_) => continue,
                    Err(e) => return this.fail(e),
                }
            }
            if this.inner_done {
                this.done = true;
                match this.finish() {
                    Ok(rest) if !rest.is_empty() => {
                        return Poll::Ready(Some(Ok(Frame::data(rest))))
                    }
                    Ok(_) => continue,
                    Err(e) => return this.fail(e),
                }
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        this.coded_bytes_seen |= !data.is_empty();
                        this.pending = data;
                    }
                    Err(frame) => {
                        this.trailers = frame.into_trailers().ok();
                        this.inner_done = true;
                    }
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => this.inner_done = true,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;

    use flate2::write::{DeflateEncoder, GzEncoder, ZlibEncoder};
    use flate2::Compression;
    use http_body_util::BodyExt;

    use super::*;

    /// A body of the frames given.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn gzip(plain: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(plain).unwrap();
        encoder.finish().unwrap()
    }

    fn zlib(plain: &[u8]) -> Vec<u8> {
        let mut encoder = ZlibEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(plain).unwrap();
        encoder.finish().unwrap()
    }

    fn raw_deflate(plain: &[u8]) -> Vec<u8> {
        let mut encoder = DeflateEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(plain).unwrap();
        encoder.finish().unwrap()
    }

    /// `coded` cut into `cut`-byte frames, then `trailers`, decoded: the data frames
    /// (their sizes) and the trailers that came out, or the error.
    async fn decode(
        coding: Coding,
        coded: &[u8],
        cut: usize,
        trailers: Option<HeaderMap>,
    ) -> Result<(Vec<u8>, Vec<usize>, Option<HeaderMap>), BoxError> {
        let mut frames: VecDeque<Frame<Bytes>> = coded
            .chunks(cut)
            .map(|chunk| Frame::data(Bytes::copy_from_slice(chunk)))
            .collect();
        frames.extend(trailers.map(Frame::trailers));
        let mut body = DecodedBody::new(Frames(frames), coding);
        let (mut plain, mut sizes, mut got_trailers) = (Vec::new(), Vec::new(), None);
        while let Some(frame) = body.frame().await {
            match frame?.into_data() {
                Ok(data) => {
                    sizes.push(data.len());
                    plain.extend_from_slice(&data);
                }
                Err(frame) => got_trailers = frame.into_trailers().ok(),
            }
        }
        assert!(body.is_end_stream());
        Ok((plain, sizes, got_trailers))
    }

    fn sample(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[tokio::test]
    async fn gzip_and_deflate_are_decoded_however_the_frames_cut_them() {
        let plain = sample(300_000);
        for (coding, coded) in [
            (Coding::Gzip, gzip(&plain)),
            (Coding::Deflate, zlib(&plain)),
            // Labelled deflate, as some servers send it.
            (Coding::Deflate, raw_deflate(&plain)),
        ] {
            for cut in [1, 7, 4096, coded.len()] {
                let (out, _, _) = decode(coding, &coded, cut, None).await.unwrap();
                assert!(out == plain, "{coding:?} cut every {cut} bytes");
            }
        }
    }

    #[tokio::test]
    async fn concatenated_gzip_members_are_one_body() {
        let coded = [gzip(b"first, "), gzip(b"second")].concat();
        let (out, _, _) = decode(Coding::Gzip, &coded, 5, None).await.unwrap();
        assert_eq!(out, b"first, second");
    }

    #[tokio::test]
    async fn a_bomb_comes_out_a_frame_at_a_time() {
        let plain = vec![b'a'; 16 << 20];
        let coded = gzip(&plain);
        assert!(coded.len() < 64 * 1024, "{} bytes coded", coded.len());
        let (out, sizes, _) = decode(Coding::Gzip, &coded, coded.len(), None)
            .await
            .unwrap();
        assert_eq!(out.len(), plain.len());
        let largest = sizes.iter().max().copied().unwrap_or(0);
        // A frame's worth, and at most one decoder step more.
        assert!(largest <= 128 * 1024, "a frame of {largest} bytes");
    }

    #[tokio::test]
    async fn trailers_follow_the_decoded_body() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        let coded = gzip(b"body");
        let (out, _, got) = decode(Coding::Gzip, &coded, 3, Some(trailers.clone()))
            .await
            .unwrap();
        assert_eq!(out, b"body");
        assert_eq!(got, Some(trailers));
    }

    #[tokio::test]
    async fn an_empty_body_is_no_stream_to_check() {
        let (out, sizes, _) = decode(Coding::Gzip, b"", 1, None).await.unwrap();
        assert!(out.is_empty() && sizes.is_empty());
    }

    #[tokio::test]
    async fn truncated_corrupt_or_trailing_bytes_are_errors() {
        let coded = gzip(&sample(10_000));
        let truncated = &coded[..coded.len() - 3];
        let mut corrupt = coded.clone();
        let middle = corrupt.len() / 2;
        corrupt[middle] ^= 0xff;
        let trailing = [zlib(b"whole"), b"more".to_vec()].concat();
        let gzip_trailing = [gzip(b"whole"), b"junk after the member".to_vec()].concat();
        for (coding, bytes, what) in [
            (Coding::Gzip, truncated.to_vec(), "truncated"),
            (Coding::Gzip, corrupt, "corrupt"),
            (Coding::Gzip, b"not gzip at all".to_vec(), "not gzip"),
            (Coding::Deflate, trailing, "bytes after the end"),
            (Coding::Gzip, gzip_trailing, "junk after a gzip member"),
            (Coding::Deflate, vec![0x78], "a deflate stream of one byte"),
        ] {
            let err = decode(coding, &bytes, 100, None).await.err();
            let err = err.unwrap_or_else(|| panic!("{what}: decoded without error"));
            assert!(
                err.to_string().contains("cannot be decoded"),
                "{what}: {err}"
            );
        }
    }

    type Pairs = [(&'static str, &'static str)];

    fn headers(pairs: &Pairs) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn the_codings_on_a_body_are_content_then_transfer_codings_under_chunked() {
        let cases: [(&Pairs, &[&str]); 7] = [
            (&[], &[]),
            (&[("content-encoding", "identity")], &[]),
            (&[("content-encoding", "GZIP")], &["gzip"]),
            (&[("transfer-encoding", "chunked")], &[]),
            (
                &[
                    ("content-encoding", "br"),
                    ("transfer-encoding", "gzip, chunked"),
                ],
                &["br", "gzip"],
            ),
            // Read to the close: every coding listed is on the bytes.
            (&[("transfer-encoding", "gzip")], &["gzip"]),
            (
                &[
                    ("content-encoding", "deflate"),
                    ("content-encoding", "gzip"),
                ],
                &["deflate", "gzip"],
            ),
        ];
        for (pairs, expected) in cases {
            let map = headers(pairs);
            let codings = [content_codings(&map), transfer_codings(&map)].concat();
            assert_eq!(codings, expected, "{pairs:?}");
        }
        let both = headers(&[
            ("content-encoding", "br"),
            ("transfer-encoding", "deflate, chunked"),
        ]);
        assert_eq!(content_codings(&both), ["br"]);
        assert_eq!(transfer_codings(&both), ["deflate"]);
        // A value that is not text names a coding that cannot be undone: a body
        // compressed under it is refused, not passed on unsearched.
        let mut unreadable = HeaderMap::new();
        let not_text = HeaderValue::from_bytes(b"gzip\xff").unwrap();
        unreadable.insert(header::CONTENT_ENCODING, not_text.clone());
        assert_eq!(content_codings(&unreadable), [UNREADABLE_CODING]);
        assert!(decoding_for(&content_codings(&unreadable)).is_err());
        unreadable.insert(header::TRANSFER_ENCODING, not_text);
        assert_eq!(transfer_codings(&unreadable), [UNREADABLE_CODING]);
    }

    #[test]
    fn only_a_single_gzip_or_deflate_is_decoded() {
        let codings = |list: &[&str]| list.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        assert_eq!(decoding_for(&[]), Ok(None));
        assert_eq!(decoding_for(&codings(&["gzip"])), Ok(Some(Coding::Gzip)));
        assert_eq!(decoding_for(&codings(&["x-gzip"])), Ok(Some(Coding::Gzip)));
        assert_eq!(
            decoding_for(&codings(&["deflate"])),
            Ok(Some(Coding::Deflate))
        );
        assert_eq!(decoding_for(&codings(&["br"])), Err("br".into()));
        assert_eq!(
            decoding_for(&codings(&["gzip", "gzip"])),
            Err("gzip, gzip".into())
        );
    }

    #[test]
    fn decoded_headers_lose_the_coding_and_length_and_weaken_the_etag() {
        let mut map = headers(&[
            ("content-encoding", "gzip"),
            ("content-length", "123"),
            ("etag", "\"v1\""),
            ("content-type", "text/plain"),
        ]);
        headers_for_decoded(&mut map);
        assert!(!map.contains_key(header::CONTENT_ENCODING));
        assert!(!map.contains_key(header::CONTENT_LENGTH));
        assert_eq!(map[header::ETAG], "W/\"v1\"");
        assert_eq!(map[header::CONTENT_TYPE], "text/plain");
        let mut weak = headers(&[("etag", "W/\"v2\"")]);
        headers_for_decoded(&mut weak);
        assert_eq!(weak[header::ETAG], "W/\"v2\"");
    }
}
