// Decodes a gzip-compressed pprof file with pprof-format (DataDog's reader) and prints it as JSON:
// sample types, every sample's stack (root first: function, file, line), values and labels.
'use strict'
const fs = require('fs')
const zlib = require('zlib')
const { Profile } = require('pprof-format')

const raw = fs.readFileSync(process.argv[2])
const profile = Profile.decode(zlib.gunzipSync(raw))
const str = (i) => profile.stringTable.strings[Number(i)]
const functions = new Map(profile.function.map((f) => [Number(f.id), f]))
const locations = new Map(profile.location.map((l) => [Number(l.id), l]))
const frame = (id) => {
  const loc = locations.get(Number(id))
  if (!loc || loc.line.length !== 1) throw new Error(`location ${id} missing or without one line`)
  const fn = functions.get(Number(loc.line[0].functionId))
  if (!fn) throw new Error(`function ${loc.line[0].functionId} missing`)
  return [str(fn.name), str(fn.filename), Number(loc.line[0].line)]
}
const out = {
  sampleTypes: profile.sampleType.map((t) => [str(t.type), str(t.unit)]),
  defaultSampleType: str(profile.defaultSampleType),
  timeNanos: Number(profile.timeNanos),
  durationNanos: Number(profile.durationNanos),
  comments: profile.comment.map(str),
  samples: profile.sample.map((s) => ({
    stack: s.locationId.map(frame).reverse(),
    values: s.value.map(Number),
    labels: Object.fromEntries(s.label.map((l) => [str(l.key), Number(l.str) ? str(l.str) : Number(l.num)]))
  }))
}
process.stdout.write(JSON.stringify(out))
