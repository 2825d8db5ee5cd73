"""``HiCache``: the one object an inference server embeds.

INTERFACE DRAFT - implementation lands once the prefix cache and controller are in. The
signatures below are stable; the server and engine code against them.

A server's request path::

    async with HiCache.from_config("configs/default.toml") as cache:
        h = await cache.begin(rid, token_ids, session_id=sid)   # match + load-back + prefetch
        # prefill tokens h.token_ids[h.prefix_len:] writing KV at h.kv_indices[h.prefix_len:];
        # attention of layer i first awaits h.wait_layer(i) (prefix KV being loaded from host)
        new = await cache.extend(h, [next_token])                # decode: slots for new tokens
        await cache.commit(h, finished=True)                     # KV into the prefix cache / session
        await cache.release_session(sid)                         # conversation over
"""
