"""Every command redis 7.0.15 has and quilld does not serve: its arity, command flags, ACL
categories and key specs, as redis's COMMAND INFO gives them.

ACL rules may name these commands (they allow or deny nothing here: quilld does not run
them), and COMMAND GETKEYS and GETKEYSANDFLAGS answer for them as redis does, from their
key specs (or, where redis's own specs are incomplete, as its getkeys functions do: SORT's
STORE, MIGRATE's KEYS). Generated from a live redis-server 7.0.15 (`COMMAND`);
tests/blackbox/test_acl.py checks it against one.
"""

from __future__ import annotations

from functools import cache

from quilld.protocol.table import Command, Doc, KeySpec as K

# name -> (arity, command flags, ACL categories, key specs)
REDIS_ONLY: dict[str, tuple[int, str, str, tuple[K, ...]]] = {
    "acl|log": (-2, "admin noscript loading stale", "admin slow dangerous", ()),
    "asking": (1, "fast", "fast connection", ()),
    "bgrewriteaof": (1, "admin noscript no_async_loading", "admin slow dangerous", ()),
    "bgsave": (-1, "admin noscript no_async_loading", "admin slow dangerous", ()),
    "blmove": (6, "write denyoom noscript blocking", "write list slow blocking",
               (K("RW access delete", index=1, range=(0, 1, 0)), K("RW insert", index=2, range=(0, 1, 0)))),
    "blmpop": (-5, "write blocking", "write list slow blocking", (K("RW access delete", index=2, keynum=(0, 1, 1)),)),
    "blpop": (-3, "write noscript blocking", "write list slow blocking",
              (K("RW access delete", index=1, range=(-2, 1, 0)),)),
    "brpop": (-3, "write noscript blocking", "write list slow blocking",
              (K("RW access delete", index=1, range=(-2, 1, 0)),)),
    "brpoplpush": (4, "write denyoom noscript blocking", "write list slow blocking",
                   (K("RW access delete", index=1, range=(0, 1, 0)), K("RW insert", index=2, range=(0, 1, 0)))),
    "bzmpop": (-5, "write blocking", "write sortedset slow blocking",
               (K("RW access delete", index=2, keynum=(0, 1, 1)),)),
    "bzpopmax": (-3, "write noscript blocking fast", "write sortedset fast blocking",
                 (K("RW access delete", index=1, range=(-2, 1, 0)),)),
    "bzpopmin": (-3, "write noscript blocking fast", "write sortedset fast blocking",
                 (K("RW access delete", index=1, range=(-2, 1, 0)),)),
    "client|unblock": (-3, "admin noscript loading stale", "admin slow dangerous connection", ()),
    "cluster": (-2, "", "slow", ()),
    "cluster|getkeysinslot": (4, "stale", "slow", ()),
    "cluster|info": (2, "stale", "slow", ()),
    "cluster|addslots": (-3, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|slaves": (3, "admin stale", "admin slow dangerous", ()),
    "cluster|saveconfig": (2, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|addslotsrange": (-4, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|countkeysinslot": (3, "stale", "slow", ()),
    "cluster|shards": (2, "stale", "slow", ()),
    "cluster|nodes": (2, "stale", "slow", ()),
    "cluster|replicate": (3, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|delslotsrange": (-4, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|links": (2, "stale", "slow", ()),
    "cluster|slots": (2, "stale", "slow", ()),
    "cluster|delslots": (-3, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|forget": (3, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|keyslot": (3, "stale", "slow", ()),
    "cluster|setslot": (-4, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|meet": (-4, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|flushslots": (2, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|help": (2, "loading stale", "slow", ()),
    "cluster|bumpepoch": (2, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|failover": (-2, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|replicas": (3, "admin stale", "admin slow dangerous", ()),
    "cluster|myid": (2, "stale", "slow", ()),
    "cluster|count-failure-reports": (3, "admin stale", "admin slow dangerous", ()),
    "cluster|set-config-epoch": (3, "admin stale no_async_loading", "admin slow dangerous", ()),
    "cluster|reset": (-2, "admin noscript stale", "admin slow dangerous", ()),
    "discard": (1, "noscript loading stale fast allow_busy", "fast transaction", ()),
    "eval": (-3, "noscript stale skip_monitor no_mandatory_keys", "slow scripting",
             (K("RW access update", index=2, keynum=(0, 1, 1)),)),
    "eval_ro": (-3, "readonly noscript stale skip_monitor no_mandatory_keys", "slow scripting",
                (K("RO access", index=2, keynum=(0, 1, 1)),)),
    "evalsha": (-3, "noscript stale skip_monitor no_mandatory_keys", "slow scripting",
                (K("RW access update", index=2, keynum=(0, 1, 1)),)),
    "evalsha_ro": (-3, "readonly noscript stale skip_monitor no_mandatory_keys", "slow scripting",
                   (K("RO access", index=2, keynum=(0, 1, 1)),)),
    "exec": (1, "noscript loading stale skip_slowlog", "slow transaction", ()),
    "failover": (-1, "admin noscript stale", "admin slow dangerous", ()),
    "fcall": (-3, "noscript stale skip_monitor no_mandatory_keys", "slow scripting",
              (K("RW access update", index=2, keynum=(0, 1, 1)),)),
    "fcall_ro": (-3, "readonly noscript stale skip_monitor no_mandatory_keys", "slow scripting",
                 (K("RO access", index=2, keynum=(0, 1, 1)),)),
    "function": (-2, "", "slow", ()),
    "function|list": (-2, "noscript", "slow scripting", ()),
    "function|dump": (2, "noscript", "slow scripting", ()),
    "function|help": (2, "loading stale", "slow scripting", ()),
    "function|load": (-3, "write denyoom noscript", "write slow scripting", ()),
    "function|restore": (-3, "write denyoom noscript", "write slow scripting", ()),
    "function|delete": (3, "write noscript", "write slow scripting", ()),
    "function|kill": (2, "noscript allow_busy", "slow scripting", ()),
    "function|flush": (-2, "write noscript", "write slow scripting", ()),
    "function|stats": (2, "noscript allow_busy", "slow scripting", ()),
    "geoadd": (-5, "write denyoom", "write geo slow", (K("RW update", index=1, range=(0, 1, 0)),)),
    "geodist": (-4, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "geohash": (-2, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "geopos": (-2, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "georadius": (-6, "write denyoom", "write geo slow", (
        K("RO access", index=1, range=(0, 1, 0)),
        K("OW update", keyword=("STORE", 6), range=(0, 1, 0)),
        K("OW update", keyword=("STOREDIST", 6), range=(0, 1, 0)),
    )),
    "georadius_ro": (-6, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "georadiusbymember": (-5, "write denyoom", "write geo slow", (
        K("RO access", index=1, range=(0, 1, 0)),
        K("OW update", keyword=("STORE", 5), range=(0, 1, 0)),
        K("OW update", keyword=("STOREDIST", 5), range=(0, 1, 0)),
    )),
    "georadiusbymember_ro": (-5, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "geosearch": (-7, "readonly", "read geo slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "geosearchstore": (-8, "write denyoom", "write geo slow",
                       (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(0, 1, 0)))),
    "hdel": (-3, "write fast", "write hash fast", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "hexists": (3, "readonly fast", "read hash fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "hget": (3, "readonly fast", "read hash fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hgetall": (2, "readonly", "read hash slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hincrby": (4, "write denyoom fast", "write hash fast", (K("RW access update", index=1, range=(0, 1, 0)),)),
    "hincrbyfloat": (4, "write denyoom fast", "write hash fast", (K("RW access update", index=1, range=(0, 1, 0)),)),
    "hkeys": (2, "readonly", "read hash slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hlen": (2, "readonly fast", "read hash fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "hmget": (-3, "readonly fast", "read hash fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hmset": (-4, "write denyoom fast", "write hash fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "hrandfield": (-2, "readonly", "read hash slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hscan": (-3, "readonly", "read hash slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "hset": (-4, "write denyoom fast", "write hash fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "hsetnx": (4, "write denyoom fast", "write hash fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "hstrlen": (3, "readonly fast", "read hash fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "hvals": (2, "readonly", "read hash slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "lastsave": (1, "loading stale fast", "admin fast dangerous", ()),
    "latency|graph": (3, "admin noscript loading stale", "admin slow dangerous", ()),
    "lindex": (3, "readonly", "read list slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "linsert": (5, "write denyoom", "write list slow", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "llen": (2, "readonly fast", "read list fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "lmove": (5, "write denyoom", "write list slow",
              (K("RW access delete", index=1, range=(0, 1, 0)), K("RW insert", index=2, range=(0, 1, 0)))),
    "lmpop": (-4, "write", "write list slow", (K("RW access delete", index=1, keynum=(0, 1, 1)),)),
    "lolwut": (-1, "readonly fast", "read fast", ()),
    "lpop": (-2, "write fast", "write list fast", (K("RW access delete", index=1, range=(0, 1, 0)),)),
    "lpos": (-3, "readonly", "read list slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "lpush": (-3, "write denyoom fast", "write list fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "lpushx": (-3, "write denyoom fast", "write list fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "lrange": (4, "readonly", "read list slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "lrem": (4, "write", "write list slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "lset": (4, "write denyoom", "write list slow", (K("RW update", index=1, range=(0, 1, 0)),)),
    "ltrim": (4, "write", "write list slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "migrate": (-6, "write", "keyspace write slow dangerous", (
        K("RW access delete", index=3, range=(0, 1, 0)),
        K("RW access delete incomplete", keyword=("KEYS", -2), range=(-1, 1, 0)),
    )),
    "module": (-2, "", "slow", ()),
    "module|list": (2, "admin noscript", "admin slow dangerous", ()),
    "module|help": (2, "loading stale", "slow", ()),
    "module|loadex": (-3, "admin noscript no_async_loading", "admin slow dangerous", ()),
    "module|load": (-3, "admin noscript no_async_loading", "admin slow dangerous", ()),
    "module|unload": (3, "admin noscript no_async_loading", "admin slow dangerous", ()),
    "move": (3, "write fast", "keyspace write fast", (K("RW access update", index=1, range=(0, 1, 0)),)),
    "multi": (1, "noscript loading stale fast allow_busy", "fast transaction", ()),
    "pfadd": (-2, "write denyoom fast", "write hyperloglog fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "pfcount": (-2, "readonly", "read hyperloglog slow", (K("RW access", index=1, range=(-1, 1, 0)),)),
    "pfdebug": (3, "write denyoom admin", "write hyperloglog admin slow dangerous",
                (K("RW access", index=2, range=(0, 1, 0)),)),
    "pfmerge": (-2, "write denyoom", "write hyperloglog slow",
                (K("RW access insert", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(-1, 1, 0)))),
    "pfselftest": (1, "admin", "hyperloglog admin slow dangerous", ()),
    "psubscribe": (-2, "pubsub noscript loading stale", "pubsub slow", ()),
    "psync": (-3, "admin noscript no_async_loading no_multi", "admin slow dangerous", ()),
    "publish": (3, "pubsub loading stale fast", "pubsub fast", ()),
    "pubsub": (-2, "", "slow", ()),
    "pubsub|channels": (-2, "pubsub loading stale", "pubsub slow", ()),
    "pubsub|numpat": (2, "pubsub loading stale", "pubsub slow", ()),
    "pubsub|help": (2, "loading stale", "slow", ()),
    "pubsub|shardnumsub": (-2, "pubsub loading stale", "pubsub slow", ()),
    "pubsub|numsub": (-2, "pubsub loading stale", "pubsub slow", ()),
    "pubsub|shardchannels": (-2, "pubsub loading stale", "pubsub slow", ()),
    "punsubscribe": (-1, "pubsub noscript loading stale", "pubsub slow", ()),
    "readonly": (1, "loading stale fast", "fast connection", ()),
    "readwrite": (1, "loading stale fast", "fast connection", ()),
    "replconf": (-1, "admin noscript loading stale allow_busy", "admin slow dangerous", ()),
    "replicaof": (3, "admin noscript stale no_async_loading", "admin slow dangerous", ()),
    "restore-asking": (-4, "write denyoom asking", "keyspace write slow dangerous",
                       (K("OW update", index=1, range=(0, 1, 0)),)),
    "role": (1, "noscript loading stale fast", "admin fast dangerous", ()),
    "rpop": (-2, "write fast", "write list fast", (K("RW access delete", index=1, range=(0, 1, 0)),)),
    "rpoplpush": (3, "write denyoom", "write list slow",
                  (K("RW access delete", index=1, range=(0, 1, 0)), K("RW insert", index=2, range=(0, 1, 0)))),
    "rpush": (-3, "write denyoom fast", "write list fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "rpushx": (-3, "write denyoom fast", "write list fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "sadd": (-3, "write denyoom fast", "write set fast", (K("RW insert", index=1, range=(0, 1, 0)),)),
    "save": (1, "admin noscript no_async_loading no_multi", "admin slow dangerous", ()),
    "scard": (2, "readonly fast", "read set fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "script": (-2, "", "slow", ()),
    "script|debug": (3, "noscript", "slow scripting", ()),
    "script|help": (2, "loading stale", "slow scripting", ()),
    "script|flush": (-2, "noscript", "slow scripting", ()),
    "script|load": (3, "noscript stale", "slow scripting", ()),
    "script|exists": (-3, "noscript", "slow scripting", ()),
    "script|kill": (2, "noscript allow_busy", "slow scripting", ()),
    "sdiff": (-2, "readonly", "read set slow", (K("RO access", index=1, range=(-1, 1, 0)),)),
    "sdiffstore": (-3, "write denyoom", "write set slow",
                   (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(-1, 1, 0)))),
    "shutdown": (-1, "admin noscript loading stale no_multi allow_busy", "admin slow dangerous", ()),
    "sinter": (-2, "readonly", "read set slow", (K("RO access", index=1, range=(-1, 1, 0)),)),
    "sintercard": (-3, "readonly", "read set slow", (K("RO access", index=1, keynum=(0, 1, 1)),)),
    "sinterstore": (-3, "write denyoom", "write set slow",
                    (K("RW update", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(-1, 1, 0)))),
    "sismember": (3, "readonly fast", "read set fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "slaveof": (3, "admin noscript stale no_async_loading", "admin slow dangerous", ()),
    "smembers": (2, "readonly", "read set slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "smismember": (-3, "readonly fast", "read set fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "smove": (4, "write fast", "write set fast",
              (K("RW access delete", index=1, range=(0, 1, 0)), K("RW insert", index=2, range=(0, 1, 0)))),
    "sort": (-2, "write denyoom", "write set sortedset list slow dangerous",
             (K("RO access", index=1, range=(0, 1, 0)), K("RO access"), K("OW update"))),
    "sort_ro": (-2, "readonly", "read set sortedset list slow dangerous",
                (K("RO access", index=1, range=(0, 1, 0)), K("RO access"))),
    "spop": (-2, "write fast", "write set fast", (K("RW access delete", index=1, range=(0, 1, 0)),)),
    "spublish": (3, "pubsub loading stale fast", "pubsub fast", (K("not_key", index=1, range=(0, 1, 0)),)),
    "srandmember": (-2, "readonly", "read set slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "srem": (-3, "write fast", "write set fast", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "sscan": (-3, "readonly", "read set slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "ssubscribe": (-2, "pubsub noscript loading stale", "pubsub slow", (K("not_key", index=1, range=(-1, 1, 0)),)),
    "sunion": (-2, "readonly", "read set slow", (K("RO access", index=1, range=(-1, 1, 0)),)),
    "sunionstore": (-3, "write denyoom", "write set slow",
                    (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(-1, 1, 0)))),
    "sunsubscribe": (-1, "pubsub noscript loading stale", "pubsub slow", (K("not_key", index=1, range=(-1, 1, 0)),)),
    "swapdb": (3, "write fast", "keyspace write fast dangerous", ()),
    "sync": (1, "admin noscript no_async_loading no_multi", "admin slow dangerous", ()),
    "unwatch": (1, "noscript loading stale fast allow_busy", "fast transaction", ()),
    "wait": (3, "noscript", "slow connection", ()),
    "watch": (-2, "noscript loading stale fast allow_busy", "fast transaction",
              (K("RO", index=1, range=(-1, 1, 0)),)),
    "xack": (-4, "write fast", "write stream fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "xadd": (-5, "write denyoom fast", "write stream fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "xautoclaim": (-6, "write fast", "write stream fast", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "xclaim": (-6, "write fast", "write stream fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "xdel": (-3, "write fast", "write stream fast", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "xgroup": (-2, "", "slow", ()),
    "xgroup|destroy": (4, "write", "write stream slow", (K("RW delete", index=2, range=(0, 1, 0)),)),
    "xgroup|delconsumer": (5, "write", "write stream slow", (K("RW delete", index=2, range=(0, 1, 0)),)),
    "xgroup|create": (-5, "write denyoom", "write stream slow", (K("RW insert", index=2, range=(0, 1, 0)),)),
    "xgroup|help": (2, "loading stale", "stream slow", ()),
    "xgroup|createconsumer": (5, "write denyoom", "write stream slow", (K("RW insert", index=2, range=(0, 1, 0)),)),
    "xgroup|setid": (-5, "write", "write stream slow", (K("RW update", index=2, range=(0, 1, 0)),)),
    "xinfo": (-2, "", "slow", ()),
    "xinfo|consumers": (4, "readonly", "read stream slow", (K("RO access", index=2, range=(0, 1, 0)),)),
    "xinfo|stream": (-3, "readonly", "read stream slow", (K("RO access", index=2, range=(0, 1, 0)),)),
    "xinfo|help": (2, "loading stale", "stream slow", ()),
    "xinfo|groups": (3, "readonly", "read stream slow", (K("RO access", index=2, range=(0, 1, 0)),)),
    "xlen": (2, "readonly fast", "read stream fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "xpending": (-3, "readonly", "read stream slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "xrange": (-4, "readonly", "read stream slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "xread": (-4, "readonly blocking", "read stream slow blocking",
              (K("RO access", keyword=("STREAMS", 1), range=(-1, 1, 2)),)),
    "xreadgroup": (-7, "write blocking", "write stream slow blocking",
                   (K("RO access", keyword=("STREAMS", 4), range=(-1, 1, 2)),)),
    "xrevrange": (-4, "readonly", "read stream slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "xsetid": (-3, "write denyoom fast", "write stream fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "xtrim": (-4, "write", "write stream slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "zadd": (-4, "write denyoom fast", "write sortedset fast", (K("RW update", index=1, range=(0, 1, 0)),)),
    "zcard": (2, "readonly fast", "read sortedset fast", (K("RO", index=1, range=(0, 1, 0)),)),
    "zcount": (4, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zdiff": (-3, "readonly", "read sortedset slow", (K("RO access", index=1, keynum=(0, 1, 1)),)),
    "zdiffstore": (-4, "write denyoom", "write sortedset slow",
                   (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, keynum=(0, 1, 1)))),
    "zincrby": (4, "write denyoom fast", "write sortedset fast", (K("RW access update", index=1, range=(0, 1, 0)),)),
    "zinter": (-3, "readonly", "read sortedset slow", (K("RO access", index=1, keynum=(0, 1, 1)),)),
    "zintercard": (-3, "readonly", "read sortedset slow", (K("RO access", index=1, keynum=(0, 1, 1)),)),
    "zinterstore": (-4, "write denyoom", "write sortedset slow",
                    (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, keynum=(0, 1, 1)))),
    "zlexcount": (4, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zmpop": (-4, "write", "write sortedset slow", (K("RW access delete", index=1, keynum=(0, 1, 1)),)),
    "zmscore": (-3, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zpopmax": (-2, "write fast", "write sortedset fast", (K("RW access delete", index=1, range=(0, 1, 0)),)),
    "zpopmin": (-2, "write fast", "write sortedset fast", (K("RW access delete", index=1, range=(0, 1, 0)),)),
    "zrandmember": (-2, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrange": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrangebylex": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrangebyscore": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrangestore": (-5, "write denyoom", "write sortedset slow",
                    (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, range=(0, 1, 0)))),
    "zrank": (3, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrem": (-3, "write fast", "write sortedset fast", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "zremrangebylex": (4, "write", "write sortedset slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "zremrangebyrank": (4, "write", "write sortedset slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "zremrangebyscore": (4, "write", "write sortedset slow", (K("RW delete", index=1, range=(0, 1, 0)),)),
    "zrevrange": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrevrangebylex": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrevrangebyscore": (-4, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zrevrank": (3, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zscan": (-3, "readonly", "read sortedset slow", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zscore": (3, "readonly fast", "read sortedset fast", (K("RO access", index=1, range=(0, 1, 0)),)),
    "zunion": (-3, "readonly", "read sortedset slow", (K("RO access", index=1, keynum=(0, 1, 1)),)),
    "zunionstore": (-4, "write denyoom", "write sortedset slow",
                    (K("OW update", index=1, range=(0, 1, 0)), K("RO access", index=2, keynum=(0, 1, 1)))),

}


def _sort_keys(argv: list) -> list[tuple[int, str]]:
    """redis's sortGetKeys: the key, and the last STORE's destination."""
    keys, store, i = [(1, "RO access")], None, 2
    while i < len(argv):
        word = bytes(argv[i]).lower()
        if word in (b"limit", b"get", b"by"):
            i += {b"limit": 2, b"get": 1, b"by": 1}[word]
        elif word == b"store" and i + 1 < len(argv):
            store = (i + 1, "OW update")
        i += 1
    return keys + ([store] if store else [])


def _migrate_keys(argv: list) -> list[tuple[int, str]]:
    """redis's migrateGetKeys: the key argument, or those after KEYS when it is empty."""
    first, num, i = 3, 1, 6
    while len(argv) > 6 and i < len(argv):
        word = bytes(argv[i]).lower()
        if word == b"keys":
            if bytes(argv[3]):
                return []
            first, num = i + 1, len(argv) - i - 1
            break
        i += {b"auth": 1, b"auth2": 2}.get(word, 0) + 1
    return [(first + k, "RW access delete") for k in range(num)]


_GETKEYS = {"sort": _sort_keys, "sort_ro": lambda argv: [(1, "RO access")], "migrate": _migrate_keys}


@cache
def command(name: str) -> Command | None:
    """A row standing for redis command `name` (`container|sub` for a subcommand), for COMMAND
    GETKEYS: what its key specs and flags tell; it has no handler."""
    row = REDIS_ONLY.get(name)
    if row is None:
        return None
    arity, flags, acl, keys = row
    doc = Doc("", "", "", flags=flags, acl=acl, keys=keys, getkeys=_GETKEYS.get(name))
    return Command(name, arity, frozenset(), _not_served, doc=doc)


def resolve(argv: list) -> Command | None:
    """The redis command `argv` names, as redis's lookupCommand resolves it, or None."""
    if not argv:
        return None
    top = bytes(argv[0]).lower().decode("utf-8", "replace")
    if len(argv) > 1 and top in _containers():
        return command(f"{top}|{bytes(argv[1]).lower().decode('utf-8', 'replace')}")
    return command(top)


@cache
def _containers() -> frozenset[str]:
    return frozenset(n.split("|")[0] for n in REDIS_ONLY if "|" in n)


def _not_served(c, args):
    raise AssertionError("a redis command quilld does not serve is never dispatched")
