{{/*
The service containers, shared by the one-pipeline workloads (coordinator and gateway Deployments, the stage
StatefulSet) and the fleet's LeaderWorkerSet (fleet-leaderworkerset.yaml). Each takes (dict "ctx" $ ...) with what
differs between the two: addresses, ports, extra arguments and "fleet".
*/}}

{{/* The coordinator container. Keys: advertiseHost, metricsPort, extraArgs (before coordinator.extraArgs), lifecycle
(YAML text), mtlsVolume, portPrefix (port names unique in a pod of several roles). */}}
{{- define "stagecast.coordinator.container" -}}
{{- $p := . -}}
{{- with .ctx -}}
{{- $c := .Values.coordinator -}}
- name: coordinator
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - coordinator
    # Bind the pod's own address only (gRPC, metrics); stages rendezvous over this mTLS gRPC port.
    - --host
    - $(POD_IP)
    - --port
    - {{ $c.port | int | quote }}
    - --advertise-host
    - {{ $p.advertiseHost | quote }}
    {{- include "stagecast.securityArgs" (dict "ctx" . "healthPort" $c.healthPort) | nindent 4 }}
    - --stages
    - {{ .Values.stages.count | int | quote }}
    {{- if gt (.Values.stages.sp | default 1 | int) 1 }}
    - --sp
    - {{ .Values.stages.sp | int | quote }}
    {{- end }}
    {{- if gt (int (.Values.stages.cfgParallel | default 1)) 1 }}
    - --cfg-parallel
    - {{ .Values.stages.cfgParallel | int | quote }}
    {{- end }}
    {{- with .Values.stages.partition }}
    - --partition
    - {{ join "," . | quote }}
    {{- end }}
    - --metrics-port
    - {{ $p.metricsPort | int | quote }}
    {{- range $p.extraArgs }}
    - {{ . | quote }}
    {{- end }}
    {{- range $c.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "stagecast.commonEnv" (dict "ctx" . "component" "coordinator") | nindent 4 }}
    {{- with $c.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ $p.portPrefix }}grpc
      containerPort: {{ $c.port }}
      protocol: TCP
    - name: {{ $p.portPrefix }}health
      containerPort: {{ $c.healthPort }}
      protocol: TCP
    - name: {{ $p.portPrefix }}metrics
      containerPort: {{ $p.metricsPort }}
      protocol: TCP
  {{- with $c.probes.startup }}
  {{- if .enabled }}
  startupProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $c.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $c.probes.readiness }}
  {{- if .enabled }}
  readinessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $c.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $c.probes.liveness }}
  {{- if .enabled }}
  livenessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $c.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $p.lifecycle }}
  lifecycle:
    {{- . | nindent 4 }}
  {{- end }}
  resources:
    {{- include "stagecast.resources" (dict "resources" $c.resources "device" "cpu" "gpus" 0) | nindent 4 }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    {{- include "stagecast.securityMounts" (dict "ctx" . "component" "coordinator" "volume" $p.mtlsVolume) | nindent 4 }}
{{- end -}}
{{- end -}}

{{/*
The gateway container, and the web container beside it when web.enabled. Keys: coordinatorAddress, fleet (TLS ends
at the door: the gateway serves plaintext), webGateway (the address the page dials: a fleet's door, so that its
streams are placed as any other), agentPort, extraArgs, mtlsVolume.
*/}}
{{- define "stagecast.gateway.containers" -}}
{{- $p := . -}}
{{- with .ctx -}}
{{- $g := .Values.gateway -}}
{{- $w := .Values.web -}}
- name: gateway
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - gateway
    - --host
    - 0.0.0.0
    - --port
    - {{ $g.port | int | quote }}
    - --health-port
    - {{ $g.healthPort | int | quote }}
    - --coordinator
    - {{ $p.coordinatorAddress | quote }}
    - --checkpoint
    - {{ include "stagecast.checkpointDir" . | quote }}
    - --device
    - {{ .Values.device | quote }}
    {{- if eq .Values.device "cuda" }}
    - --vae-dtype
    - {{ .Values.dtype | quote }}
    {{- if $g.vaeCompile }}
    - --vae-compile
    {{- end }}
    {{- if $g.vaeCudaGraphs }}
    - --vae-cuda-graphs
    {{- end }}
    {{- if $g.tinyCudaGraphs }}
    - --tiny-cuda-graphs
    {{- end }}
    {{- if gt (int $g.gpus) 1 }}
    {{- $devices := list }}
    {{- range $i := until (int $g.gpus) }}
    {{- $devices = append $devices (printf "cuda:%d" $i) }}
    {{- end }}
    - --vae-devices
    - {{ join "," $devices | quote }}
    {{- end }}
    {{- end }}
    {{- with $g.tinyDecoder }}
    - --tiny-decoder
    - {{ printf "%s/%s" (trimSuffix "/" $.ctx.Values.model.mountPath) . | quote }}
    {{- end }}
    {{- if eq ($g.defaultDecoder | default "full") "tiny" }}
    - --default-decoder
    - tiny
    {{- end }}
    {{- if $g.decoderMemoryGib }}
    - --decoder-memory-gib
    - {{ $g.decoderMemoryGib | toString | quote }}
    {{- end }}
    - --max-streams
    - {{ $g.maxStreams | int | quote }}
    - --max-streams-per-client
    - {{ $g.quotas.streams | int | quote }}
    - --max-unpaced-per-client
    - {{ $g.quotas.unpaced | int | quote }}
    - --max-pending-per-client
    - {{ $g.quotas.pending | int | quote }}
    - --max-watchers-per-client
    - {{ $g.quotas.watchers | int | quote }}
    - --metrics-port
    - {{ .Values.metrics.port | int | quote }}
    {{- include "stagecast.securityArgs" (dict "ctx" .) | nindent 4 }}
    # One bearer token per tenant, from the tokens Secret (re-read when the Secret changes).
    - --tokens
    - /etc/stagecast/tokens/tokens
    {{- if and .Values.security.gatewayTLS.enabled (not $p.fleet) }}
    - --tls-cert
    - /etc/stagecast/gateway-tls/tls.crt
    - --tls-key
    - /etc/stagecast/gateway-tls/tls.key
    {{- end }}
    {{- range $p.extraArgs }}
    - {{ . | quote }}
    {{- end }}
    {{- range $g.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "stagecast.commonEnv" (dict "ctx" . "component" "gateway") | nindent 4 }}
    {{- with $g.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $g.port }}
      protocol: TCP
    - name: health
      containerPort: {{ $g.healthPort }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .Values.metrics.port }}
      protocol: TCP
    {{- with $p.agentPort }}
    - name: agent
      containerPort: {{ . }}
      protocol: TCP
    {{- end }}
  {{- with $g.probes.startup }}
  {{- if .enabled }}
  startupProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $g.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $g.probes.readiness }}
  {{- if .enabled }}
  readinessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $g.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $g.probes.liveness }}
  {{- if .enabled }}
  livenessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $g.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  resources:
    {{- include "stagecast.resources" (dict "resources" $g.resources "device" .Values.device "gpus" $g.gpus) | nindent 4 }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- include "stagecast.modelVolumeMount" . | nindent 4 }}
    - name: tmp
      mountPath: /tmp
    {{- include "stagecast.securityMounts" (dict "ctx" . "component" "gateway" "volume" $p.mtlsVolume) | nindent 4 }}
    {{- if $g.shm.enabled }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
{{- if $w.enabled }}
# The live page, WebRTC and the WebSocket fallback; a client of the gateway's public API like any other.
- name: web
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - web
    - --host
    - 0.0.0.0
    - --port
    - {{ $w.port | int | quote }}
    - --gateway
    {{- if .Values.security.gatewayTLS.enabled }}
    # TLS: by the Service name its certificate holds.
    - {{ $p.webGateway | default (printf "%s.%s.svc.%s:%d" (include "stagecast.gateway.fullname" .) .Release.Namespace .Values.clusterDomain (int $g.port)) | quote }}
    - --gateway-ca
    - /etc/stagecast/gateway-tls/ca.crt
    {{- else }}
    - {{ $p.webGateway | default (printf "127.0.0.1:%d" (int $g.port)) | quote }}
    {{- end }}
    - --tokens
    - /etc/stagecast/tokens/tokens
    - --max-peers
    - {{ $w.maxPeers | int | quote }}
    - --peer-timeout
    - {{ $w.peerTimeout | quote }}
    {{- if eq $w.media.mode "hostNetwork" }}
    - --ice-host
    - $(HOST_IP)
    {{- end }}
    {{- if eq $w.media.mode "turn" }}
    - --turn
    - {{ $w.media.turn.url | quote }}
    {{- with $w.media.turn.username }}
    - --turn-username
    - {{ . | quote }}
    {{- end }}
    {{- if $w.media.turn.credentialSecret }}
    - --turn-credential-file
    - /etc/stagecast/turn/credential
    {{- end }}
    {{- end }}
    {{- range $w.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "stagecast.commonEnv" (dict "ctx" . "component" "web") | nindent 4 }}
    - name: HOST_IP
      valueFrom:
        fieldRef:
          fieldPath: status.hostIP
  ports:
    - name: http
      containerPort: {{ $w.port }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: 5
  livenessProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $w.resources | nindent 4 }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: tokens
      mountPath: /etc/stagecast/tokens
      readOnly: true
    {{- if .Values.security.gatewayTLS.enabled }}
    - name: gateway-tls
      mountPath: /etc/stagecast/gateway-tls
      readOnly: true
    {{- end }}
    {{- if and (eq $w.media.mode "turn") $w.media.turn.credentialSecret }}
    - name: turn
      mountPath: /etc/stagecast/turn
      readOnly: true
    {{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
The stage container. Keys: coordinatorAddress, advertiseHost, metricsPort, healthPort, command, fleet (the index from
the command rather than the pod-index label), lifecycle (YAML text), mtlsVolume, portPrefix.
*/}}
{{- define "stagecast.stage.container" -}}
{{- $p := . -}}
{{- with .ctx -}}
{{- $s := .Values.stages -}}
- name: stage
  image: {{ include "stagecast.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with $p.command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  args:
    - stage
    {{- if $p.fleet }}
    # --index comes from STAGECAST_STAGE_INDEX, the LeaderWorkerSet worker index less one (command, above).
    {{- else }}
    # --index comes from STAGECAST_STAGE_INDEX (pod-index label, below).
    {{- end }}
    - --coordinator
    - {{ $p.coordinatorAddress | quote }}
    - --checkpoint
    - {{ include "stagecast.checkpointDir" . | quote }}
    - --device
    - {{ .Values.device | quote }}
    {{- if gt ($s.sp | default 1 | int) 1 }}
    - --sp
    - {{ $s.sp | int | quote }}
    {{- end }}
    {{- if eq .Values.device "cuda" }}
    - --dtype
    - {{ .Values.dtype | quote }}
    {{- if $s.cudaGraphs }}
    - --cuda-graphs
    {{- end }}
    {{- if $s.fp8 }}
    - --fp8
    {{- end }}
    {{- end }}
    # Bind the pod's own address only: gRPC, metrics, and the data plane (NCCL / gloo use the interface
    # that holds it: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME).
    - --host
    - $(POD_IP)
    - --port
    - {{ $s.port | int | quote }}
    - --advertise-host
    - {{ $p.advertiseHost | quote }}
    - --metrics-port
    - {{ $p.metricsPort | int | quote }}
    {{- include "stagecast.securityArgs" (dict "ctx" . "healthPort" $p.healthPort) | nindent 4 }}
    {{- range $s.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- if not $p.fleet }}
    - name: STAGECAST_STAGE_INDEX
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
    {{- end }}
    {{- include "stagecast.commonEnv" (dict "ctx" . "component" "stage") | nindent 4 }}
    {{- with $s.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ $p.portPrefix }}grpc
      containerPort: {{ $s.port }}
      protocol: TCP
    - name: {{ $p.portPrefix }}metrics
      containerPort: {{ $p.metricsPort }}
      protocol: TCP
    - name: {{ $p.portPrefix }}health
      containerPort: {{ $p.healthPort }}
      protocol: TCP
  {{- with $s.probes.startup }}
  {{- if .enabled }}
  startupProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $p.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $s.probes.readiness }}
  {{- if .enabled }}
  readinessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $p.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $s.probes.liveness }}
  {{- if .enabled }}
  livenessProbe:
    {{- include "stagecast.grpcProbe" (dict "port" $p.healthPort "probe" .) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with $p.lifecycle }}
  lifecycle:
    {{- . | nindent 4 }}
  {{- end }}
  resources:
    {{- include "stagecast.resources" (dict "resources" $s.resources "device" .Values.device "gpus" $s.gpusPerStage) | nindent 4 }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- include "stagecast.modelVolumeMount" . | nindent 4 }}
    - name: tmp
      mountPath: /tmp
    {{- include "stagecast.securityMounts" (dict "ctx" . "component" "stage" "volume" $p.mtlsVolume) | nindent 4 }}
    {{- if $s.shm.enabled }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
{{- end -}}
{{- end -}}
