"""KV persistence: a conversation's attention state kept on disk and in memory across turns and restarts.
The turn uses one door, front.py; the bytes live in storage/kv/. The words, each for one thing:

position        one token's place in a sequence; everything here is stored and restored per position
rows            what a cache holds per position (CacheLog.rows, in the family's record order)
record          one position in a file: token id, payload (its rows in the record dtype), crc32c
geometry        what a file's records hold (header: format version, widths, record dtype)
state           what stored values depend on beyond the model: compute dtype, activation path
log             a session's append-only file of positions, one of two kinds:
  record log    a record per position (format 2; storage/kv/log.py KVLog, logs.py RecordLog): MLA models
  lean log      DeepSeek-V4's (format 4; storage/kv/lean_log.py LeanLog, logs.py LeanSessionLog): per
                position the entries it closes, plus snapshots
  entries       the compressed entries a lean log appends per position (CacheLog.entries)
  snapshot      a lean log's window state at a position (CacheLog.window), every snapshot_every positions
                and at its end; bookmark: the one at a turn's last prompt position
  restore point a position a log restores exactly (any for a record log; a lean log's snapshots)
session         a named conversation: its log, its lock (lock.py), chat's transcript (transcript.py)
pool            sessions held open with their cache between turns (pool.py; serve)
prefix cache    prompt prefixes' KV shared by every turn of a model (prefix_cache.py), in blocks
  block         64 positions' records keyed by a hash chain over the prefix (storage/kv/prefix_blocks.py),
                held in RAM and a directory (storage/kv/prefix_store.py)
  tenant        whose blocks they are: an id derived from an API key (none without keys), folded into the
                hash chain, so a key finds its own blocks only (unless the operator shares them)
  pack          a file of one prefix's blocks, `kv export` / `kv import` (packs.py, storage/kv/pack.py),
                its values checked against the model before import (pack_checks.py)
  origin        where an imported block's values came from (the pack, its digest, the time): its header
restore         build a cache from stored positions; the RestoredPrefix is what a turn starts from, its
                length the turn's reused_tokens
commit          persist a turn's positions: blocks remembered, the log appended (fsynced)
sync            append the log mid-turn (sync_every); remember: add blocks to the prefix cache

Rooms, lowest first: records.py (cache <-> payloads, RestoredPrefix); lock.py, transcript.py; logs.py;
sessions.py; pool.py, prefix_cache.py; pack_checks.py; packs.py; front.py (Persistence, KVState).
"""
