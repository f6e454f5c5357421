// The conversation a request belongs to, so that nginx sends every turn of one conversation to the same kvfree
// replica: the one whose prefix cache (or GPU slot) holds its state. Any replica can still serve any turn (sessions
// live in Redis, and a prefix cache miss only re-prefills): this key only saves that work.
//
// In order: the X-Session-Id header (kvfree's client sends it), the body's session_id, its prompt_cache_key
// (OpenAI's field, scoped by the caller's API key), else the opening of the conversation itself: an agent framework
// re-sends the whole conversation every turn, so its first messages (or its prompt's first characters) are the
// same from turn to turn, and name it without any change to the client.
function conversation(r) {
    var session = r.headersIn['X-Session-Id'];
    if (session) {
        return session;
    }
    var body;
    try {
        body = JSON.parse(r.requestText || '{}');
    } catch (e) {
        return r.variables.request_id;  // not JSON: no conversation to keep together
    }
    var key = r.headersIn['Authorization'] || '';
    if (typeof body.session_id === 'string') {
        return body.session_id;
    }
    if (typeof body.prompt_cache_key === 'string') {
        return key + '|' + body.prompt_cache_key;
    }
    if (Array.isArray(body.messages) && body.messages.length) {
        return key + '|' + JSON.stringify(body.messages.slice(0, 2));
    }
    var opening = body.prompt !== undefined ? body.prompt : body.input;
    if (opening !== undefined) {
        return key + '|' + JSON.stringify(opening).slice(0, 4096);
    }
    return r.variables.request_id;
}

export default {conversation};
