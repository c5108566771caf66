//! A batch: one subscription's events in flight in one lane, and the state
//! of each (docs/design/subscriptions.md, "Two events of one subject in one
//! batch"; docs/design/claims-1.0.md).
//!
//! Claims lease batches, not rows: a batch row holds its events' ids and one
//! small state per event, so the common case (every event acked on its first
//! try) writes one row per claim, not one per event. A lane has at most one
//! batch, and it slides: a claim that wants more than the batch can hand out
//! appends the lane's next events to it ([`Batch::append`]), and drops the
//! events that are finished ([`Batch::compact`]). So an event out for long,
//! heartbeat or not, holds only the later events of its own subject, never
//! its lane. This module is that state and its rules, with no storage:
//! [`Batch::encode`] and [`Batch::decode`] give the bytes the row keeps.
//!
//! # The rules, and why they keep the claim contract
//! - **One event per subject at a time.** Each event keeps its subject's key
//!   (`hashtext`; None without a subject) and the previous unfinished event
//!   of its key in the batch (`prev`). An event is *handable* only when it is
//!   waiting and its `prev` is done. Events are appended in the order the
//!   lane's windows read them, which per subject is commit order
//!   (src/log/mod.rs), so a subject's events go out one at a time in commit
//!   order; events without a subject have no `prev` and go out at once. Two
//!   subjects with one key only wait for each other.
//! - **Each event goes out of a batch at most once.** Every later delivery of
//!   it (after a failure or an expired lease) is from the exception table
//!   (src/log/exceptions.rs), so attempts beyond the first are counted there.
//! - **Rounds and fencing.** Each hand-out is a *round* with its own random
//!   part and lease expiry. Each event out gets its own token: (batch, the
//!   id's low 16 bits, [`event_random`] of the round's random part and the
//!   id) ([`Token`]), so no two events share one, and one event's token says
//!   nothing usable about another's. An ack or fail is accepted only if the
//!   event is out in a round whose random part gives the token's; a parked
//!   or acked event accepts nothing from the batch's side. Tokens do not
//!   depend on positions, which compaction changes.
//! - **One lease per event.** Extending one event of a round moves it to a
//!   round of its own with the same random part (so its token stays valid)
//!   and the later expiry ([`Batch::extend`]); its round's other events keep
//!   theirs.
//! - **Parking.** An event that leaves the batch is *parked* together with every
//!   later event of its subject in the batch, and the caller moves them all to
//!   the exception table, where they follow it in id order: a failed event
//!   ([`Batch::park`]), an event whose lease expired ([`Batch::expire`]), and
//!   a subject the caller sends there whole ([`Batch::divert`],
//!   [`Batch::detach`]). A subject's unfinished events are in the batch or in
//!   the exception table, never in both: one failing subject never holds the
//!   batch, and the exception table's order rules cover a subject there.
//! - **Finished** when every event is done or parked; compaction drops those,
//!   and a finished batch is deleted.

use std::collections::HashMap;
use std::fmt;

/// The encoding's version byte (3: events in append order with their subject
/// keys).
const VERSION: u8 = 3;

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

/// One hand-out: the random part of its token, when it was handed out and
/// when its lease expires (TimestampTz microseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    pub random: u64,
    pub handed: i64,
    pub expires: i64,
}

/// A lease token of a batch round, as the `uuid` workers hold. It is an RFC 9562
/// version 8 (vendor-specific) UUID, so ack, fail and extend_lease know from the
/// token alone where the lease is kept ([`TokenKind`]), and a uuid of another
/// kind (`gen_random_uuid()`, version 4) matches no lease:
///
/// | bytes | content |
/// |---|---|
/// | 0..6 | batch id, 48 bits, big-endian |
/// | 6 | `0x80` (version 8) with the kind in the low nibble (0: a batch round) |
/// | 7, 9 | the event id's low 16 bits, high and low byte (a check) |
/// | 8 | `0x80` (the RFC variant), low six bits zero |
/// | 10..16 | random part, 48 bits |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub batch: i64,
    /// The event id's low 16 bits: a token of one event names no other
    /// whatever the batch's order.
    pub tag: u16,
    /// 48 bits.
    pub random: u64,
}

/// The random part of a token keeps 48 bits.
pub const RANDOM_MASK: u64 = (1 << 48) - 1;

/// The random part of the token of event `id` handed out in a round whose
/// random part is `round`: SplitMix64's finaliser over both, so that the
/// events of one round get unrelated tokens, cut to 48 bits.
pub fn event_random(round: u64, id: i64) -> u64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    mix((round & RANDOM_MASK) ^ mix(id as u64)) & RANDOM_MASK
}

/// Largest batch id a token can name (the sequence `outbox.log_batch_seq` stops there).
pub const MAX_BATCH_ID: i64 = (1 << 48) - 1;

/// Where a lease token's lease is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// Not a token this extension hands out (another version or kind).
    Foreign,
    /// A batch round ([`Token`]).
    Batch,
    /// A lease of a row of the exception table ([`exception_token`]).
    Exception,
}

/// The kind of the token spelled by `b`.
pub fn token_kind(b: &[u8; 16]) -> TokenKind {
    if b[6] >> 4 != 8 || b[8] >> 6 != 2 {
        return TokenKind::Foreign;
    }
    match b[6] & 0x0f {
        0 => TokenKind::Batch,
        1 => TokenKind::Exception,
        _ => TokenKind::Foreign,
    }
}

/// A fresh token for a lease of exception-table rows: version 8, kind 1, and
/// 118 random bits from `r1`, `r2`.
pub fn exception_token(r1: u64, r2: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&r1.to_be_bytes());
    b[8..].copy_from_slice(&r2.to_be_bytes());
    b[6] = 0x81;
    b[8] = 0x80 | (b[8] & 0x3f);
    b
}

impl Token {
    /// The 16 bytes of the token's uuid.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..6].copy_from_slice(&(self.batch & MAX_BATCH_ID).to_be_bytes()[2..]);
        b[6] = 0x80;
        let tag = self.tag.to_be_bytes();
        b[7] = tag[0];
        b[8] = 0x80;
        b[9] = tag[1];
        b[10..].copy_from_slice(&(self.random & RANDOM_MASK).to_be_bytes()[2..]);
        b
    }

    /// The token a uuid spells; any 16 bytes spell one, and a uuid not made by
    /// [`Token::to_bytes`] simply matches no batch.
    pub fn from_bytes(b: [u8; 16]) -> Token {
        let mut batch = [0u8; 8];
        batch[2..].copy_from_slice(&b[..6]);
        let mut random = [0u8; 8];
        random[2..].copy_from_slice(&b[10..]);
        Token {
            batch: i64::from_be_bytes(batch),
            tag: u16::from_be_bytes([b[7], b[9]]),
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
    /// In the order they were appended (per subject: commit order).
    ids: Vec<i64>,
    /// The subject key of each event (None: no subject).
    keys: Vec<Option<u32>>,
    /// Index of the previous unfinished event of the same key, if any.
    prev: Vec<Option<u16>>,
    state: Vec<State>,
    rounds: Vec<Round>,
    /// Position of each id.
    at: HashMap<i64, u16>,
}

/// What [`Batch::compact`] dropped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Compacted {
    /// The ids of the events that were done (acked), in batch order.
    pub done: Vec<i64>,
    /// For each round kept, in its new order, its number before.
    pub rounds_from: Vec<u16>,
}

impl Batch {
    /// A batch of `events` (id, subject key) in the lanes' reading order; every
    /// event waiting. Panics past [`MAX_EVENTS`] or on a repeated id.
    pub fn new(events: &[(i64, Option<u32>)]) -> Batch {
        let mut b =
            Batch { ids: vec![], keys: vec![], prev: vec![], state: vec![], rounds: vec![], at: HashMap::new() };
        b.append(events);
        b
    }

    /// Append `events` (id, subject key), read after every event already in
    /// the batch; each waits behind the last unfinished event of its key.
    /// Panics past [`MAX_EVENTS`] or on an id already in the batch (the caller
    /// reads each event once: src/log/mod.rs).
    pub fn append(&mut self, events: &[(i64, Option<u32>)]) {
        assert!(self.len() + events.len() <= MAX_EVENTS, "batch too large");
        let mut last: HashMap<u32, u16> = HashMap::new();
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(k) = k {
                if matches!(self.state[i], State::Waiting | State::Out(_)) {
                    last.insert(*k, i as u16);
                }
            }
        }
        for &(id, key) in events {
            let i = self.ids.len() as u16;
            assert!(self.at.insert(id, i).is_none(), "event {id} appended twice");
            self.ids.push(id);
            self.keys.push(key);
            self.prev.push(key.and_then(|k| last.insert(k, i)));
            self.state.push(State::Waiting);
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

    /// The event ids, in batch order.
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// The subject key of event `i`.
    pub fn key(&self, i: usize) -> Option<u32> {
        self.keys[i]
    }

    /// The state of event `i` (0-based position).
    pub fn state(&self, i: usize) -> State {
        self.state[i]
    }

    /// The position of event `id`.
    pub fn position(&self, id: i64) -> Option<usize> {
        self.at.get(&id).map(|&i| usize::from(i))
    }

    fn expired(&self, round: u16, now: i64) -> bool {
        self.rounds[round as usize - 1].expires <= now
    }

    /// How many events of key `k` are waiting or out.
    pub fn unfinished_of(&self, k: u32) -> usize {
        (0..self.len())
            .filter(|&i| self.keys[i] == Some(k) && matches!(self.state[i], State::Waiting | State::Out(_)))
            .count()
    }

    /// How many events are done or parked (what [`Batch::compact`] drops).
    pub fn finished_count(&self) -> usize {
        self.state.iter().filter(|s| matches!(s, State::Done | State::Parked)).count()
    }

    /// Whether a claim at `now` has anything to do with this batch besides
    /// appending: it is finished, an event is handable, or a round's lease
    /// expired ([`Batch::expire`]).
    pub fn wants_claim(&self, now: i64) -> bool {
        self.finished()
            || !self.handable().is_empty()
            || self.state.iter().any(|s| matches!(s, State::Out(r) if self.expired(*r, now)))
    }

    /// Positions a claim may hand out, in batch order: waiting events whose
    /// subject's previous event is done. (An event whose lease expired is not
    /// handed out again from the batch: [`Batch::expire`] moves it out first.)
    pub fn handable(&self) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| {
                self.state[i] == State::Waiting && self.prev[i].is_none_or(|p| self.state[p as usize] == State::Done)
            })
            .collect()
    }

    /// Park the events whose round's lease expired at `now`, each with every
    /// later event of its subject in the batch; returns the parked positions in
    /// batch order, each with true when it was out (its expired attempt counts)
    /// and false for an event parked behind one. The caller moves them all to
    /// the exception table, where the expired ones are claimed again.
    pub fn expire(&mut self, now: i64) -> Vec<(usize, bool)> {
        let expired = self.expired_events(now);
        self.expire_at(&expired)
    }

    /// The positions of the events out whose lease expired at `now`.
    pub fn expired_events(&self, now: i64) -> Vec<usize> {
        (0..self.len()).filter(|&i| matches!(self.state[i], State::Out(r) if self.expired(r, now))).collect()
    }

    /// [`Batch::expire`] for the expired events at `expired` only (those no
    /// transaction holds: src/log/deferred.rs).
    pub fn expire_at(&mut self, expired: &[usize]) -> Vec<(usize, bool)> {
        let mut parked = Vec::new();
        for &i in expired {
            parked.push((i, true));
            parked.extend(self.park_after(i).into_iter().map(|j| (j, false)));
            self.state[i] = State::Parked;
        }
        parked.sort_unstable();
        parked
    }

    /// Take the events at `positions` out of the batch, whatever their state:
    /// waiting ones are parked, ones out are parked and returned with their
    /// round (their holder keeps the lease, from the exception table), done
    /// ones stay. For a subject that moves to the exception table whole (a
    /// replayed event goes before it, or the claim sends it there). Returns
    /// (position, round if it was out).
    pub fn detach(&mut self, positions: &[usize]) -> Vec<(usize, Option<u16>)> {
        let mut out = Vec::new();
        for &i in positions {
            match self.state[i] {
                State::Waiting => out.push((i, None)),
                State::Out(r) => out.push((i, Some(r))),
                State::Done | State::Parked => continue,
            }
            self.state[i] = State::Parked;
        }
        out
    }

    /// The positions of the unfinished (waiting or out) events of key `k`.
    pub fn unfinished_positions(&self, k: u32) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| self.keys[i] == Some(k) && matches!(self.state[i], State::Waiting | State::Out(_)))
            .collect()
    }

    /// Park every waiting event of the subject of event `i` (before and after
    /// it; `i` alone without a subject), for an event the claim does not hand
    /// out from the batch (delayed, or outside the claim's topics): its subject
    /// then continues from the exception table, in id order. Events already
    /// done stay done. Returns the parked positions. Panics if an event of the
    /// subject is out: a claim diverts a subject with an event out by
    /// [`Batch::detach`] instead.
    pub fn divert(&mut self, i: usize) -> Vec<usize> {
        let all: Vec<usize> = match self.keys[i] {
            None => {
                if self.state[i] == State::Waiting {
                    vec![i]
                } else {
                    vec![]
                }
            }
            Some(k) => {
                (0..self.len()).filter(|&j| self.keys[j] == Some(k) && self.state[j] == State::Waiting).collect()
            }
        };
        if let Some(k) = self.keys[i] {
            assert!(
                (0..self.len()).all(|j| self.keys[j] != Some(k) || !matches!(self.state[j], State::Out(_))),
                "divert of a subject with an event out"
            );
        }
        for &j in &all {
            self.state[j] = State::Parked;
        }
        all
    }

    /// Hand out the positions `picks` (from [`Batch::handable`]) at `now` as a
    /// new round with lease expiry `expires` and random part `random`; returns
    /// the round. Each event's token is then [`Batch::token`]. Panics if a
    /// pick is not handable, or after `u16::MAX` rounds.
    pub fn hand_out(&mut self, picks: &[usize], now: i64, expires: i64, random: u64) -> u16 {
        let handable = self.handable();
        assert!(picks.iter().all(|p| handable.contains(p)), "hand_out of an event that is not handable");
        assert!(self.rounds.len() < u16::MAX as usize, "too many rounds");
        self.rounds.push(Round { random: random & RANDOM_MASK, handed: now, expires });
        let round = self.rounds.len() as u16;
        for &p in picks {
            self.state[p] = State::Out(round);
        }
        round
    }

    /// Check that `token` currently holds event `id`; returns its position.
    pub fn holder(&self, id: i64, token: Token) -> Result<usize, Refused> {
        let i = self.position(id).ok_or(Refused::NotInBatch)?;
        match self.state[i] {
            State::Out(r)
                if token.tag == id as u16
                    && event_random(self.rounds[r as usize - 1].random, id) == token.random & RANDOM_MASK =>
            {
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
        parked.extend(self.park_after(i));
        self.state[i] = State::Parked;
        Ok(parked)
    }

    /// Park every later waiting event of the subject of event `i`; returns them.
    fn park_after(&mut self, i: usize) -> Vec<usize> {
        let Some(k) = self.keys[i] else { return vec![] };
        let later: Vec<usize> =
            (i + 1..self.len()).filter(|&j| self.keys[j] == Some(k) && self.state[j] == State::Waiting).collect();
        for &j in &later {
            self.state[j] = State::Parked;
        }
        later
    }

    /// Set the lease expiry of event `id` to `expires` (a heartbeat; shorter
    /// is allowed, as for a row of its own), if `token` holds it; its round's
    /// other events keep their expiry. Returns (the round it was out in, the
    /// round it is out in now): an event that shared its round moves to a new
    /// one with the same random part and hand-out time, so its token still
    /// holds it.
    pub fn extend(&mut self, id: i64, token: Token, expires: i64) -> Result<(u16, u16), Refused> {
        let i = self.holder(id, token)?;
        let State::Out(r) = self.state[i] else { unreachable!("holder() returned an event not out") };
        let shared = (0..self.len()).any(|j| j != i && self.state[j] == State::Out(r));
        let old = self.rounds[r as usize - 1];
        if !shared {
            self.rounds[r as usize - 1].expires = expires;
            return Ok((r, r));
        }
        if self.rounds.len() >= u16::MAX as usize {
            // No round left to split into: the round keeps one lease, the
            // later one, so that no other event's lease is cut short.
            self.rounds[r as usize - 1].expires = old.expires.max(expires);
            return Ok((r, r));
        }
        self.rounds.push(Round { expires, ..old });
        let own = self.rounds.len() as u16;
        self.state[i] = State::Out(own);
        Ok((r, own))
    }

    /// When round `round`'s lease expires, if the round exists.
    pub fn round_expiry(&self, round: u16) -> Option<i64> {
        self.rounds.get((round as usize).checked_sub(1)?).map(|r| r.expires)
    }

    /// The round event `i` is out in, if it is out.
    pub fn round_of(&self, i: usize) -> Option<u16> {
        match self.state[i] {
            State::Out(r) => Some(r),
            _ => None,
        }
    }

    /// When the lease of event `i` expires, if it is out.
    pub fn expiry(&self, i: usize) -> Option<i64> {
        self.round_expiry(self.round_of(i)?)
    }

    /// The token of event `i` of batch `batch`, if it is out.
    pub fn token(&self, batch: i64, i: usize) -> Option<Token> {
        self.token_in_round(batch, i, self.round_of(i)?)
    }

    /// The token event `i` of batch `batch` has, or had, when out in round
    /// `round` (for an event just parked out of that round, which keeps its
    /// token in the exception table), if the round exists.
    pub fn token_in_round(&self, batch: i64, i: usize, round: u16) -> Option<Token> {
        let r = self.rounds.get((round as usize).checked_sub(1)?)?;
        let id = self.ids[i];
        Some(Token { batch, tag: id as u16, random: event_random(r.random, id) })
    }

    /// How many events are out in a round whose lease has not expired at `now`.
    pub fn out_unexpired(&self, now: i64) -> usize {
        self.state.iter().filter(|s| matches!(s, State::Out(r) if !self.expired(*r, now))).count()
    }

    /// True when every event is done or parked.
    pub fn finished(&self) -> bool {
        self.state.iter().all(|s| matches!(s, State::Done | State::Parked))
    }

    /// Drop the events that are done or parked and the rounds no event is out
    /// in any more. The events left keep their order, states and tokens (a
    /// token names its event by id, not by position); an event whose `prev`
    /// was dropped was behind a done one, so it has none now.
    pub fn compact(&mut self) -> Compacted {
        let keep: Vec<usize> =
            (0..self.len()).filter(|&i| matches!(self.state[i], State::Waiting | State::Out(_))).collect();
        let done: Vec<i64> = (0..self.len()).filter(|&i| self.state[i] == State::Done).map(|i| self.ids[i]).collect();
        let mut new_pos: HashMap<usize, u16> = HashMap::new();
        for (n, &i) in keep.iter().enumerate() {
            new_pos.insert(i, n as u16);
        }
        let mut rounds_from: Vec<u16> = keep.iter().filter_map(|&i| self.round_of(i)).collect();
        rounds_from.sort_unstable();
        rounds_from.dedup();
        let new_round: HashMap<u16, u16> = rounds_from.iter().enumerate().map(|(n, &r)| (r, n as u16 + 1)).collect();
        let rounds = rounds_from.iter().map(|&r| self.rounds[r as usize - 1]).collect();
        let mut b = Batch { ids: vec![], keys: vec![], prev: vec![], state: vec![], rounds, at: HashMap::new() };
        for &i in &keep {
            b.at.insert(self.ids[i], b.ids.len() as u16);
            b.ids.push(self.ids[i]);
            b.keys.push(self.keys[i]);
            b.prev.push(self.prev[i].and_then(|p| new_pos.get(&(p as usize)).copied()));
            b.state.push(match self.state[i] {
                State::Out(r) => State::Out(new_round[&r]),
                s => s,
            });
        }
        *self = b;
        Compacted { done, rounds_from }
    }

    /// A finished batch of `done` (acked) events only: what `outbox.log_delivered`
    /// keeps of a compaction.
    pub fn delivered(done: &[i64]) -> Batch {
        let mut b = Batch::new(&done.iter().map(|&id| (id, None)).collect::<Vec<_>>());
        b.state.iter_mut().for_each(|s| *s = State::Done);
        b
    }

    /// The bytes a batch row keeps: a version byte, the event count, each id
    /// as a zigzag varint delta from the previous one (the first from 0), each
    /// key as a varint (0: none, else key + 1), each `prev` as a varint
    /// distance back (0: none), each state as a varint (0 waiting, 1 done, 2
    /// parked, 2 + r out in round r), then the rounds (count, and for each the
    /// random part as 6 bytes, the hand-out time and the expiry as 8 each).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.len() * 9 + self.rounds.len() * 22);
        out.push(VERSION);
        put_varint(&mut out, self.len() as u64);
        let mut last = 0i64;
        for &id in &self.ids {
            let d = id.wrapping_sub(last);
            put_varint(&mut out, ((d << 1) ^ (d >> 63)) as u64);
            last = id;
        }
        for k in &self.keys {
            put_varint(&mut out, k.map_or(0, |k| u64::from(k) + 1));
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
            out.extend_from_slice(&r.handed.to_be_bytes());
            out.extend_from_slice(&r.expires.to_be_bytes());
        }
        out
    }

    /// The batch `bytes` spell, checked: ids distinct, `prev` pointing back
    /// to an event of the same key, rounds that exist.
    pub fn decode(bytes: &[u8]) -> Result<Batch, Corrupt> {
        let mut r = Reader { bytes, at: 0 };
        if r.byte()? != VERSION {
            return Err(Corrupt("unknown version"));
        }
        let n = r.varint()? as usize;
        if n > MAX_EVENTS {
            return Err(Corrupt("too many events"));
        }
        let mut ids = Vec::with_capacity(n);
        let mut at = HashMap::with_capacity(n);
        let mut last = 0i64;
        for i in 0..n {
            let z = r.varint()?;
            let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
            last = last.wrapping_add(d);
            if at.insert(last, i as u16).is_some() {
                return Err(Corrupt("an id appears twice"));
            }
            ids.push(last);
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(match r.varint()? {
                0 => None,
                k if k <= u64::from(u32::MAX) + 1 => Some((k - 1) as u32),
                _ => return Err(Corrupt("key out of range")),
            });
        }
        let mut prev = Vec::with_capacity(n);
        for i in 0..n {
            let back = r.varint()? as usize;
            prev.push(match back {
                0 => None,
                b if b <= i && keys[i].is_some() && keys[i - b] == keys[i] => Some((i - b) as u16),
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
            let mut handed = [0u8; 8];
            handed.copy_from_slice(r.take(8)?);
            let mut expires = [0u8; 8];
            expires.copy_from_slice(r.take(8)?);
            rounds.push(Round {
                random: u64::from_be_bytes(random),
                handed: i64::from_be_bytes(handed),
                expires: i64::from_be_bytes(expires),
            });
        }
        if r.at != bytes.len() {
            return Err(Corrupt("trailing bytes"));
        }
        if state.iter().any(|s| matches!(s, State::Out(r) if *r == 0 || *r as usize > rounds_n)) {
            return Err(Corrupt("state names a missing round"));
        }
        Ok(Batch { ids, keys, prev, state, rounds, at })
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
    const A: Option<u32> = Some(1);
    const B: Option<u32> = Some(2);

    fn batch() -> Batch {
        // ids 10..=15: subjects a, b, a, none, b, a
        Batch::new(&[(10, A), (11, B), (12, A), (13, None), (14, B), (15, A)])
    }

    /// Hand out `picks` of batch 7 as a new round; the token of each event by id.
    fn out(b: &mut Batch, picks: &[usize], expires: i64, random: u64) -> HashMap<i64, Token> {
        b.hand_out(picks, T0, expires, random);
        picks.iter().map(|&p| (b.ids()[p], b.token(7, p).unwrap())).collect()
    }

    #[pg_test]
    fn one_event_per_subject_in_id_order() {
        let mut b = batch();
        assert_eq!(b.handable(), vec![0, 1, 3]);
        let t1 = out(&mut b, &[0, 1, 3], T0 + 30, 0xabc);
        assert_eq!(b.handable(), Vec::<usize>::new());
        b.ack(10, t1[&10]).unwrap();
        assert_eq!(b.handable(), vec![2]); // a's next; b's next waits for 11
        b.ack(11, t1[&11]).unwrap();
        b.ack(13, t1[&13]).unwrap();
        assert_eq!(b.handable(), vec![2, 4]);
        let t2 = out(&mut b, &[2, 4], T0 + 30, 0xdef);
        b.ack(12, t2[&12]).unwrap();
        b.ack(14, t2[&14]).unwrap();
        assert!(!b.finished());
        let t3 = out(&mut b, &[5], T0 + 30, 1);
        b.ack(15, t3[&15]).unwrap();
        assert!(b.finished());
        assert_eq!(b.out_unexpired(T0), 0);
    }

    #[pg_test]
    fn each_event_of_a_round_has_its_own_token() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 0xabc);
        let randoms: std::collections::HashSet<u64> = t.values().map(|t| t.random).collect();
        assert_eq!(randoms.len(), 3);
        // One event's token holds no other event.
        assert_eq!(b.ack(11, t[&10]), Err(Refused::Stale));
        assert_eq!(b.ack(11, Token { tag: 11, ..t[&10] }), Err(Refused::Stale));
        b.ack(11, t[&11]).unwrap();
        // Ids 65,536 apart share their low bits, not their tokens.
        let mut c = Batch::new(&[(1, None), (65_537, None)]);
        let tc = out(&mut c, &[0, 1], T0 + 30, 5);
        assert_ne!(tc[&1], tc[&65_537]);
        assert_eq!(c.ack(65_537, tc[&1]), Err(Refused::Stale));
    }

    #[pg_test]
    fn an_appended_event_waits_behind_its_subject_and_slow_events_hold_nothing_else() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        // 10 (a) is slow; the lane's next events come in: c, a, none.
        b.append(&[(20, Some(3)), (21, A), (22, None)]);
        // c and the event without a subject go at once; a's waits for 12 and 15 first.
        assert_eq!(b.handable(), vec![6, 8]);
        b.ack(10, t[&10]).unwrap();
        let t2 = out(&mut b, &[2], T0 + 30, 6);
        b.ack(12, t2[&12]).unwrap();
        let t3 = out(&mut b, &[5], T0 + 30, 7);
        b.ack(15, t3[&15]).unwrap();
        // 14 (b) still waits for 11; a's next is free now.
        assert_eq!(b.handable(), vec![6, 7, 8]);
    }

    #[pg_test]
    fn compaction_keeps_states_order_and_tokens() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        b.ack(11, t[&11]).unwrap();
        b.ack(13, t[&13]).unwrap();
        let t2 = out(&mut b, &[4], T0 + 60, 6);
        b.append(&[(30, A)]);
        let c = b.compact();
        assert_eq!(c.done, vec![11, 13]);
        assert_eq!(c.rounds_from, vec![1, 2]);
        assert_eq!(b.ids(), &[10, 12, 14, 15, 30]);
        assert_eq!(b.handable(), Vec::<usize>::new()); // 12, 15, 30 wait behind 10
        assert_eq!(b.expiry(b.position(14).unwrap()), Some(T0 + 60));
        // Tokens name events, not positions: they still hold.
        b.ack(14, t2[&14]).unwrap();
        b.ack(10, t[&10]).unwrap();
        assert_eq!(b.handable(), vec![b.position(12).unwrap()]);
        assert_eq!(Batch::decode(&b.encode()), Ok(b.clone()));
    }

    #[pg_test]
    fn an_expired_event_leaves_the_batch_with_its_successors() {
        let mut b = batch();
        let old = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        b.ack(13, old[&13]).unwrap();
        // Expired but not moved yet: an ack is still accepted.
        b.ack(11, old[&11]).unwrap();
        assert_eq!(b.expire(T0 + 29), vec![]);
        // 10 expired: it and a's later events (12, 15) leave; 14 (b) goes on.
        assert_eq!(b.expire(T0 + 30), vec![(0, true), (2, false), (5, false)]);
        assert_eq!(b.ack(10, old[&10]), Err(Refused::Stale));
        assert_eq!(b.park(10, old[&10]), Err(Refused::Stale));
        assert_eq!(b.extend(10, old[&10], T0 + 999), Err(Refused::Stale));
        assert_eq!(b.ack(99, old[&10]), Err(Refused::NotInBatch));
        assert_eq!(b.handable(), vec![4]);
        let t = out(&mut b, &[4], T0 + 60, 6)[&14];
        // Same event, other random part: stale.
        assert_eq!(b.ack(14, Token { random: t.random ^ 1, ..t }), Err(Refused::Stale));
        b.ack(14, t).unwrap();
        assert_eq!(b.ack(14, t), Err(Refused::Stale));
        assert!(b.finished());
    }

    #[pg_test]
    fn detach_parks_waiting_and_out_events_and_leaves_done_ones() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        b.ack(10, t[&10]).unwrap();
        // a's events: 10 done, 12 now handable, 15 waiting; 12 goes out.
        let t2 = out(&mut b, &[2], T0 + 30, 6);
        assert_eq!(b.unfinished_positions(1), vec![2, 5]);
        assert_eq!(b.detach(&[0, 2, 5]), vec![(2, Some(2)), (5, None)]);
        assert_eq!(b.ack(12, t2[&12]), Err(Refused::Stale));
        assert_eq!(b.state(0), State::Done);
    }

    #[pg_test]
    fn divert_takes_a_whole_subject() {
        let mut b = batch();
        // 12 (a) is delayed: every event of a leaves, earlier 10 too.
        assert_eq!(b.divert(2), vec![0, 2, 5]);
        // An event without a subject leaves alone.
        assert_eq!(b.divert(3), vec![3]);
        let t = out(&mut b, &[1], T0 + 30, 1);
        b.ack(11, t[&11]).unwrap();
        // An acked event stays done when its subject is diverted.
        assert_eq!(b.divert(4), vec![4]);
        assert_eq!(b.state(1), State::Done);
        assert!(b.finished());
    }

    #[pg_test]
    fn a_failed_event_parks_its_subject_and_frees_the_batch() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        assert_eq!(b.park(10, t[&10]).unwrap(), vec![0, 2, 5]);
        assert_eq!(b.handable(), Vec::<usize>::new()); // 14 waits for 11 still
        b.ack(11, t[&11]).unwrap();
        b.ack(13, t[&13]).unwrap();
        let t2 = out(&mut b, &[4], T0 + 30, 9);
        b.ack(14, t2[&14]).unwrap();
        assert!(b.finished());
    }

    #[pg_test]
    fn extend_moves_one_event_to_a_lease_of_its_own() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 5);
        assert_eq!(b.extend(10, t[&10], T0 + 50), Ok((1, 2)));
        // Its token still holds it; a second extension changes its own round only.
        assert_eq!(b.extend(10, t[&10], T0 + 100), Ok((2, 2)));
        assert_eq!(b.expiry(0), Some(T0 + 100));
        assert_eq!(b.expiry(1), Some(T0 + 30));
        assert_eq!(b.expiry(3), Some(T0 + 30));
        // The neighbours expire; the extended event does not.
        assert_eq!(b.expire(T0 + 30), vec![(1, true), (3, true), (4, false)]);
        assert!(b.expire(T0 + 99).is_empty());
        assert_eq!(b.token(7, 0), Some(t[&10]));
        b.ack(10, t[&10]).unwrap();
    }

    #[pg_test]
    fn tokens_round_trip_through_uuid_bytes() {
        for t in [
            Token { batch: 0, tag: 0, random: 0 },
            Token { batch: MAX_BATCH_ID, tag: u16::MAX, random: RANDOM_MASK },
            Token { batch: 5, tag: 300, random: 0x1234_5678_9abc },
        ] {
            assert_eq!(Token::from_bytes(t.to_bytes()), t);
            assert_eq!(token_kind(&t.to_bytes()), TokenKind::Batch);
        }
        let x = exception_token(u64::MAX, u64::MAX);
        assert_eq!(token_kind(&x), TokenKind::Exception);
        // gen_random_uuid() makes version 4: not a token of ours.
        let mut q = x;
        q[6] = 0x4f;
        assert_eq!(token_kind(&q), TokenKind::Foreign);
        assert_eq!(token_kind(&exception_token(0, 0)), TokenKind::Exception);
        // The random part keeps 48 bits; higher bits are dropped on both sides.
        let t = Token { batch: 1, tag: 1, random: u64::MAX };
        assert_eq!(Token::from_bytes(t.to_bytes()).random, RANDOM_MASK);
    }

    #[pg_test]
    fn encoding_round_trips_and_stays_small() {
        let mut b = batch();
        let t = out(&mut b, &[0, 1, 3], T0 + 30, 77);
        b.ack(10, t[&10]).unwrap();
        b.append(&[(5, None), (40, A)]); // a late committer below the batch's ids
        assert_eq!(Batch::decode(&b.encode()), Ok(b.clone()));
        let dense: Vec<(i64, Option<u32>)> = (0..500).map(|i| (1_000_000_000 + i, Some((i % 7) as u32))).collect();
        let big = Batch::new(&dense);
        let bytes = big.encode();
        assert!(bytes.len() < 2100, "{} bytes", bytes.len());
        assert_eq!(Batch::decode(&bytes), Ok(big));
        assert_eq!(Batch::decode(&Batch::new(&[]).encode()), Ok(Batch::new(&[])));
        let d = Batch::delivered(&[3, 9, 4]);
        assert!(d.finished() && Batch::decode(&d.encode()) == Ok(d.clone()));
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
        assert!(Batch::decode(&[1, 0, 0]).is_err());
        // A state naming a round that does not exist.
        let mut b = batch();
        b.hand_out(&[0], T0, T0 + 1, 1);
        let mut bytes = b.encode();
        let rounds_at = bytes.len() - 23;
        bytes[rounds_at] = 0; // zero rounds...
        assert_eq!(Batch::decode(&bytes), Err(Corrupt("trailing bytes")));
        bytes.truncate(rounds_at + 1); // ...and none stored
        assert_eq!(Batch::decode(&bytes), Err(Corrupt("state names a missing round")));
    }
}
