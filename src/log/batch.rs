//! A batch: one subscription's lease of a slice of one lane's window, and the
//! state of each event in it (docs/design/subscriptions.md, "Two events of one
//! subject in one batch").
//!
//! Claims will lease batches, not rows: a batch row holds the slice's event
//! ids and one small state per event, so the common case (every event acked on
//! its first try) writes one row per batch, not one per event. This module is
//! that state and its rules, with no storage: [`Batch::encode`] and
//! [`Batch::decode`] give the bytes the row keeps.
//!
//! # The rules, and why they keep the claim contract
//! - **One event per subject at a time.** Each event knows the previous event
//!   of its subject in the batch (`prev`). An event is *handable* only when it
//!   is waiting (or its round's lease expired) and its `prev` is done. So a
//!   subject's events go out one at a time, in id order, which within a lane is
//!   commit order (src/log/mod.rs); events without a subject have no `prev` and
//!   all go out at once.
//! - **Rounds and fencing.** Each hand-out is a *round* with its own random
//!   part and lease expiry; its events carry the token (batch, round, random)
//!   ([`Token`]). An ack or fail is accepted only if the event is out in that
//!   very round with that random part. An expired event handed out again joins
//!   a new round, so the old token matches nothing: a stale holder can never
//!   ack, fail or extend a re-handed event.
//! - **Parking.** A failed event leaves the batch (the caller moves it to the
//!   exception table with its retry time) and is *parked*; every later event
//!   of its subject in the batch is parked with it, so they follow it in order
//!   from the exception table, and one failing subject never holds the batch.
//! - **Finished** when every event is done or parked: the lane's cursor may
//!   then move past the batch.

use std::fmt;

/// Most events one batch holds (state indexes are `u16`).
pub const MAX_EVENTS: usize = u16::MAX as usize;

/// What became of one event of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Not handed out yet (its subject's earlier event is not done).
    Waiting,
    /// Handed out in this round (1-based).
    Out(u16),
    /// Acked.
    Done,
    /// Moved to the exception table (failed, or behind a failed event).
    Parked,
}

/// One hand-out: the random part of its token and when its lease expires
/// (TimestampTz microseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    pub random: u64,
    pub expires: i64,
}

/// A lease token, as the `uuid` workers hold: batch id (8 bytes, big-endian),
/// round (2 bytes), random part (6 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub batch: i64,
    pub round: u16,
    /// 48 bits.
    pub random: u64,
}

/// The random part of a token keeps 48 bits.
pub const RANDOM_MASK: u64 = (1 << 48) - 1;

impl Token {
    /// The 16 bytes of the token's uuid.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.batch.to_be_bytes());
        b[8..10].copy_from_slice(&self.round.to_be_bytes());
        b[10..].copy_from_slice(&(self.random & RANDOM_MASK).to_be_bytes()[2..]);
        b
    }

    /// The token a uuid spells; any 16 bytes spell one, and a uuid not made by
    /// [`Token::to_bytes`] simply matches no batch.
    pub fn from_bytes(b: [u8; 16]) -> Token {
        let mut batch = [0u8; 8];
        batch.copy_from_slice(&b[..8]);
        let mut random = [0u8; 8];
        random[2..].copy_from_slice(&b[10..]);
        Token {
            batch: i64::from_be_bytes(batch),
            round: u16::from_be_bytes([b[8], b[9]]),
            random: u64::from_be_bytes(random),
        }
    }
}

/// Why an ack, fail or extension of an event was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The event is not in this batch.
    NotInBatch,
    /// The token's round or random part does not match the event's current
    /// hand-out (a stale holder: the event was handed out again, acked, parked).
    Stale,
}

/// Why bytes are not a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt(&'static str);

impl fmt::Display for Corrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt batch state: {}", self.0)
    }
}

/// The events of one batch and their state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    ids: Vec<i64>,
    /// Index of the previous event of the same subject, if any.
    prev: Vec<Option<u16>>,
    state: Vec<State>,
    rounds: Vec<Round>,
}

impl Batch {
    /// A batch of `events` (id, subject key), ids strictly ascending, at most
    /// [`MAX_EVENTS`]; every event waiting. Panics otherwise (the caller reads
    /// them from the lane's index in id order).
    pub fn new<K: Eq + std::hash::Hash>(events: &[(i64, Option<K>)]) -> Batch {
        assert!(events.len() <= MAX_EVENTS, "batch too large");
        assert!(events.windows(2).all(|w| w[0].0 < w[1].0), "ids must ascend");
        let mut last = std::collections::HashMap::new();
        let prev = events
            .iter()
            .enumerate()
            .map(|(i, (_, key))| key.as_ref().and_then(|k| last.insert(k, i as u16)))
            .collect();
        Batch {
            ids: events.iter().map(|e| e.0).collect(),
            prev,
            state: vec![State::Waiting; events.len()],
            rounds: vec![],
        }
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when the batch holds no event.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The event ids, ascending.
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// The state of event `i` (0-based position).
    pub fn state(&self, i: usize) -> State {
        self.state[i]
    }

    /// The position of event `id`.
    pub fn position(&self, id: i64) -> Option<usize> {
        self.ids.binary_search(&id).ok()
    }

    fn expired(&self, round: u16, now: i64) -> bool {
        self.rounds[round as usize - 1].expires <= now
    }

    /// Positions a claim may hand out at `now`, in id order: waiting events, or
    /// events whose round expired, whose subject's previous event is done.
    pub fn handable(&self, now: i64) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| {
                let free = match self.state[i] {
                    State::Waiting => true,
                    State::Out(r) => self.expired(r, now),
                    State::Done | State::Parked => false,
                };
                free && self.prev[i].is_none_or(|p| self.state[p as usize] == State::Done)
            })
            .collect()
    }

    /// Hand out the positions `picks` (from [`Batch::handable`]) as a new round
    /// with lease expiry `expires` and random part `random`; returns the round's
    /// token for batch `batch_id`. Panics if a pick is not handable, or after
    /// `u16::MAX` rounds.
    pub fn hand_out(&mut self, batch_id: i64, picks: &[usize], now: i64, expires: i64, random: u64) -> Token {
        let handable = self.handable(now);
        assert!(picks.iter().all(|p| handable.contains(p)), "hand_out of an event that is not handable");
        assert!(self.rounds.len() < u16::MAX as usize, "too many rounds");
        self.rounds.push(Round { random: random & RANDOM_MASK, expires });
        let round = self.rounds.len() as u16;
        for &p in picks {
            self.state[p] = State::Out(round);
        }
        Token { batch: batch_id, round, random: random & RANDOM_MASK }
    }

    /// Check that `token` currently holds event `id`; returns its position.
    pub fn holder(&self, id: i64, token: Token) -> Result<usize, Refused> {
        let i = self.position(id).ok_or(Refused::NotInBatch)?;
        match self.state[i] {
            State::Out(r) if r == token.round && self.rounds[r as usize - 1].random == token.random & RANDOM_MASK => {
                Ok(i)
            }
            _ => Err(Refused::Stale),
        }
    }

    /// Ack event `id` held by `token`. An ack after the lease expired is still
    /// accepted while no other claim has handed the event out again, as an ack
    /// of an expired but not yet reclaimed row is today.
    pub fn ack(&mut self, id: i64, token: Token) -> Result<(), Refused> {
        let i = self.holder(id, token)?;
        self.state[i] = State::Done;
        Ok(())
    }

    /// Park event `id` held by `token` (it failed and moves to the exception
    /// table) and every later event of its subject in the batch; returns the
    /// parked positions, the failed one first, so the caller moves them all.
    pub fn park(&mut self, id: i64, token: Token) -> Result<Vec<usize>, Refused> {
        let i = self.holder(id, token)?;
        let mut parked = vec![i];
        for j in i + 1..self.len() {
            if self.prev[j].is_some_and(|p| parked.contains(&(p as usize))) {
                parked.push(j);
            }
        }
        for &p in &parked {
            self.state[p] = State::Parked;
        }
        Ok(parked)
    }

    /// Extend the lease of the round `token` names to `expires`, if `token`
    /// holds event `id`. Every event of that round gets the later expiry (a
    /// round shares one lease: a heartbeat for one event of a concurrently
    /// handled batch keeps its siblings too).
    pub fn extend(&mut self, id: i64, token: Token, expires: i64) -> Result<(), Refused> {
        self.holder(id, token)?;
        let r = &mut self.rounds[token.round as usize - 1];
        r.expires = r.expires.max(expires);
        Ok(())
    }

    /// When round `round`'s lease expires, if the round exists.
    pub fn round_expiry(&self, round: u16) -> Option<i64> {
        self.rounds.get((round as usize).checked_sub(1)?).map(|r| r.expires)
    }

    /// True when every event is done or parked.
    pub fn finished(&self) -> bool {
        self.state.iter().all(|s| matches!(s, State::Done | State::Parked))
    }

    /// The earliest lease expiry among events still out, if any.
    pub fn next_expiry(&self) -> Option<i64> {
        self.state
            .iter()
            .filter_map(|s| match s {
                State::Out(r) => Some(self.rounds[*r as usize - 1].expires),
                _ => None,
            })
            .min()
    }

    /// The bytes a batch row keeps: a version byte, the event count, each id as
    /// a varint delta from the previous one (the first from 0), each `prev` as a
    /// varint distance back (0: none), each state as a varint (0 waiting, 1
    /// done, 2 parked, 2 + r out in round r), then the rounds (count, and for
    /// each the random part as 6 bytes and the expiry as 8). A batch of 500
    /// events with dense ids takes about 1.5 KB, under the TOAST threshold.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.len() * 4 + self.rounds.len() * 14);
        out.push(1);
        put_varint(&mut out, self.len() as u64);
        let mut last = 0i64;
        for &id in &self.ids {
            put_varint(&mut out, id.wrapping_sub(last) as u64);
            last = id;
        }
        for (i, p) in self.prev.iter().enumerate() {
            put_varint(&mut out, p.map_or(0, |p| (i - p as usize) as u64));
        }
        for s in &self.state {
            put_varint(
                &mut out,
                match s {
                    State::Waiting => 0,
                    State::Done => 1,
                    State::Parked => 2,
                    State::Out(r) => 2 + *r as u64,
                },
            );
        }
        put_varint(&mut out, self.rounds.len() as u64);
        for r in &self.rounds {
            out.extend_from_slice(&r.random.to_be_bytes()[2..]);
            out.extend_from_slice(&r.expires.to_be_bytes());
        }
        out
    }

    /// The batch `bytes` spell, checked: ids ascending, `prev` pointing back,
    /// rounds that exist.
    pub fn decode(bytes: &[u8]) -> Result<Batch, Corrupt> {
        let mut r = Reader { bytes, at: 0 };
        if r.byte()? != 1 {
            return Err(Corrupt("unknown version"));
        }
        let n = r.varint()? as usize;
        if n > MAX_EVENTS {
            return Err(Corrupt("too many events"));
        }
        let mut ids = Vec::with_capacity(n);
        let mut last = 0i64;
        for i in 0..n {
            let d = r.varint()?;
            if i > 0 && d == 0 {
                return Err(Corrupt("ids must ascend"));
            }
            last = last.checked_add_unsigned(d).ok_or(Corrupt("id overflow"))?;
            ids.push(last);
        }
        let mut prev = Vec::with_capacity(n);
        for i in 0..n {
            let back = r.varint()? as usize;
            prev.push(match back {
                0 => None,
                b if b <= i => Some((i - b) as u16),
                _ => return Err(Corrupt("prev out of range")),
            });
        }
        let mut state = Vec::with_capacity(n);
        for _ in 0..n {
            state.push(match r.varint()? {
                0 => State::Waiting,
                1 => State::Done,
                2 => State::Parked,
                v if v - 2 <= u16::MAX as u64 => State::Out((v - 2) as u16),
                _ => return Err(Corrupt("round out of range")),
            });
        }
        let rounds_n = r.varint()? as usize;
        if rounds_n > u16::MAX as usize {
            return Err(Corrupt("too many rounds"));
        }
        let mut rounds = Vec::with_capacity(rounds_n);
        for _ in 0..rounds_n {
            let mut random = [0u8; 8];
            random[2..].copy_from_slice(r.take(6)?);
            let mut expires = [0u8; 8];
            expires.copy_from_slice(r.take(8)?);
            rounds.push(Round { random: u64::from_be_bytes(random), expires: i64::from_be_bytes(expires) });
        }
        if r.at != bytes.len() {
            return Err(Corrupt("trailing bytes"));
        }
        if state.iter().any(|s| matches!(s, State::Out(r) if *r == 0 || *r as usize > rounds_n)) {
            return Err(Corrupt("state names a missing round"));
        }
        Ok(Batch { ids, prev, state, rounds })
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Result<u8, Corrupt> {
        let b = *self.bytes.get(self.at).ok_or(Corrupt("truncated"))?;
        self.at += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        let s = self.bytes.get(self.at..self.at + n).ok_or(Corrupt("truncated"))?;
        self.at += n;
        Ok(s)
    }

    fn varint(&mut self) -> Result<u64, Corrupt> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= ((b & 0x7f) as u64).checked_shl(shift).ok_or(Corrupt("varint overflow"))?;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Corrupt("varint too long"))
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    const T0: i64 = 1_000_000;

    fn batch() -> Batch {
        // ids 10..=15: subjects a, b, a, none, b, a
        Batch::new(&[(10, Some("a")), (11, Some("b")), (12, Some("a")), (13, None), (14, Some("b")), (15, Some("a"))])
    }

    #[pg_test]
    fn one_event_per_subject_in_id_order() {
        let mut b = batch();
        assert_eq!(b.handable(T0), vec![0, 1, 3]);
        let t1 = b.hand_out(7, &[0, 1, 3], T0, T0 + 30, 0xabc);
        assert_eq!(b.handable(T0), Vec::<usize>::new());
        b.ack(10, t1).unwrap();
        assert_eq!(b.handable(T0), vec![2]); // a's next; b's next waits for 11
        b.ack(11, t1).unwrap();
        b.ack(13, t1).unwrap();
        assert_eq!(b.handable(T0), vec![2, 4]);
        let t2 = b.hand_out(7, &[2, 4], T0, T0 + 30, 0xdef);
        b.ack(12, t2).unwrap();
        b.ack(14, t2).unwrap();
        assert!(!b.finished());
        let t3 = b.hand_out(7, &[5], T0, T0 + 30, 1);
        b.ack(15, t3).unwrap();
        assert!(b.finished());
        assert_eq!(b.next_expiry(), None);
    }

    #[pg_test]
    fn a_stale_token_after_a_reclaim_is_refused() {
        let mut b = batch();
        let old = b.hand_out(7, &[0, 1, 3], T0, T0 + 30, 5);
        // The lease expires; the events go out again in a new round.
        assert_eq!(b.handable(T0 + 30), vec![0, 1, 3]);
        let new = b.hand_out(7, &[0, 1, 3], T0 + 30, T0 + 60, 6);
        assert_eq!(b.ack(10, old), Err(Refused::Stale));
        assert_eq!(b.park(11, old), Err(Refused::Stale));
        assert_eq!(b.extend(13, old, T0 + 999), Err(Refused::Stale));
        // Same round number, other random part: also stale.
        assert_eq!(b.ack(10, Token { random: 7, ..new }), Err(Refused::Stale));
        assert_eq!(b.ack(99, new), Err(Refused::NotInBatch));
        b.ack(10, new).unwrap();
        // Twice.
        assert_eq!(b.ack(10, new), Err(Refused::Stale));
        // An expired but not reclaimed hand-out can still be acked.
        assert!(b.handable(T0 + 61).contains(&1));
        b.ack(11, new).unwrap();
    }

    #[pg_test]
    fn a_failed_event_parks_its_subject_and_frees_the_batch() {
        let mut b = batch();
        let t = b.hand_out(7, &[0, 1, 3], T0, T0 + 30, 5);
        assert_eq!(b.park(10, t).unwrap(), vec![0, 2, 5]);
        assert_eq!(b.handable(T0), Vec::<usize>::new()); // 14 waits for 11 still
        b.ack(11, t).unwrap();
        b.ack(13, t).unwrap();
        let t2 = b.hand_out(7, &[4], T0, T0 + 30, 9);
        b.ack(14, t2).unwrap();
        assert!(b.finished());
    }

    #[pg_test]
    fn extend_keeps_the_round_and_never_shortens_it() {
        let mut b = batch();
        let t = b.hand_out(7, &[0, 1, 3], T0, T0 + 30, 5);
        b.extend(10, t, T0 + 100).unwrap();
        b.extend(11, t, T0 + 50).unwrap();
        assert_eq!(b.next_expiry(), Some(T0 + 100));
        assert!(b.handable(T0 + 99).is_empty());
    }

    #[pg_test]
    fn tokens_round_trip_through_uuid_bytes() {
        for t in [
            Token { batch: 0, round: 1, random: 0 },
            Token { batch: i64::MAX, round: u16::MAX, random: RANDOM_MASK },
            Token { batch: -5, round: 300, random: 0x1234_5678_9abc },
        ] {
            assert_eq!(Token::from_bytes(t.to_bytes()), t);
        }
        // The random part keeps 48 bits; higher bits are dropped on both sides.
        let t = Token { batch: 1, round: 1, random: u64::MAX };
        assert_eq!(Token::from_bytes(t.to_bytes()).random, RANDOM_MASK);
    }

    #[pg_test]
    fn encoding_round_trips_and_stays_small() {
        let mut b = batch();
        let t = b.hand_out(42, &[0, 1, 3], T0, T0 + 30, 77);
        b.ack(10, t).unwrap();
        assert_eq!(Batch::decode(&b.encode()), Ok(b.clone()));
        let dense: Vec<(i64, Option<u32>)> = (0..500).map(|i| (1_000_000_000 + i, Some((i % 7) as u32))).collect();
        let big = Batch::new(&dense);
        let bytes = big.encode();
        assert!(bytes.len() < 1600, "{} bytes", bytes.len());
        assert_eq!(Batch::decode(&bytes), Ok(big));
        assert_eq!(Batch::decode(&Batch::new::<u32>(&[]).encode()), Ok(Batch::new::<u32>(&[])));
    }

    #[pg_test]
    fn corrupt_bytes_are_refused_not_trusted() {
        let good = batch().encode();
        for cut in 0..good.len() {
            assert!(Batch::decode(&good[..cut]).is_err(), "a prefix of {cut} bytes decoded");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(Batch::decode(&trailing).is_err());
        assert!(Batch::decode(&[2, 0, 0]).is_err());
        // A state naming a round that does not exist.
        let mut b = batch();
        b.hand_out(1, &[0], T0, T0 + 1, 1);
        let mut bytes = b.encode();
        let rounds_at = bytes.len() - 15;
        bytes[rounds_at] = 0; // zero rounds...
        assert_eq!(Batch::decode(&bytes), Err(Corrupt("trailing bytes")));
        bytes.truncate(rounds_at + 1); // ...and none stored
        assert_eq!(Batch::decode(&bytes), Err(Corrupt("state names a missing round")));
    }
}
